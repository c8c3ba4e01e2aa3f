"""Profiles: named machine shapes a user picks from, with KubeSpawner 7.1's `profile_list` shape.

A profile has `display_name`, optional `slug`, `description`, `default`, `version`,
`kubevirt_override` (spawner settings it changes), `profile_options` (choices inside the profile,
each with its own `kubevirt_override`, and an optional `unlisted_choice`, a value the user types)
and `allowed_users` / `allowed_groups` (who may start it). The options a user sends are KubeSpawner's:
`{"profile": SLUG, OPTION: CHOICE, "OPTION--unlisted-choice": VALUE}`. Pure functions only; the
spawner evaluates callable override values and applies the overrides (spawner.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import jinja2

# The settings a profile may change (names of KubeVirtSpawner traits).
OVERRIDABLE = {"cpu_guarantee", "cpu_limit", "mem_guarantee", "mem_limit", "memory_guest", "gpus", "node_selector",
               "tolerations", "affinity", "root_disk_size", "golden_image", "workspace_disk_size", "storage_class",
               "extra_labels", "extra_annotations", "termination_grace_period", "firmware", "ssh_enabled",
               "priority_class_name", "extra_vm_spec", "extra_vm_template_spec", "shared_data",
               "scratch_disk_size", "extra_disks"}
UNLISTED = "--unlisted-choice"  # KubeSpawner's suffix of an option's own value
UNLISTED_IN_FORM = "unlisted-choice"  # the value of the select's "Other..." entry (KubeSpawner's)
VALUE_MAX = 256  # an unlisted value lands in settings (an image name, a label): no essays
_OPTION_KEY = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_]|-(?!-))*$")  # no "--": it separates the suffix
_PRINTABLE = re.compile(r"^[^\x00-\x1f\x7f]*$")
_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")  # apimachinery's

FORM = jinja2.Environment(loader=jinja2.PackageLoader("kubevirt_spawner", "templates"), autoescape=True)


class ProfileError(ValueError):
    """A profile choice or a profile_list that cannot be used; the text says why."""


@dataclass(frozen=True)
class Selection:
    """A profile and what the user chose in it: `options` holds only validated keys (an option's
    choice or its `--unlisted-choice` value), so it can be stored and read back."""
    profile: dict
    options: dict = field(default_factory=dict)

    @property
    def slug(self) -> str:
        return self.profile["slug"]


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "profile"


def as_list(profile_list) -> list:
    """A profile_list given as a dict is its values in the order of their keys (KubeSpawner 7.1)."""
    if isinstance(profile_list, dict):
        return [profile_list[key] for key in sorted(profile_list)]
    return list(profile_list or [])


def _check_override(where: str, override) -> dict:
    if override is None:
        return {}
    if not isinstance(override, dict):
        raise ProfileError(f"{where}: kubevirt_override must be a dict of settings")
    unknown = sorted(set(override) - OVERRIDABLE)
    if unknown:
        raise ProfileError(f"{where}: kubevirt_override cannot set {', '.join(map(str, unknown))}; "
                           f"allowed: {', '.join(sorted(OVERRIDABLE))}")
    return dict(override)


def _names(where: str, key: str, raw) -> tuple[str, ...] | None:
    if raw is None:
        return None
    if isinstance(raw, str) or not all(isinstance(n, str) and n for n in raw):
        raise ProfileError(f"{where}: {key} must be a list of names")
    return tuple(raw)


def _normalise_option(where: str, key, raw) -> dict:
    if not isinstance(key, str) or not _OPTION_KEY.match(key) or key == "profile":
        raise ProfileError(f"{where}: the option name {key!r} must be letters, digits, '_' or single '-' "
                           "(and not 'profile')")
    where = f"{where} option {key}"
    if not isinstance(raw, dict):
        raise ProfileError(f"{where} must be a dict")
    choices = {}
    for ckey, choice in (raw.get("choices") or {}).items():
        if not isinstance(ckey, str) or not ckey or ckey == UNLISTED_IN_FORM or not isinstance(choice, dict):
            raise ProfileError(f"{where}: choice {ckey!r} must be a dict under a name other than "
                               f"{UNLISTED_IN_FORM!r}")
        choices[ckey] = {**choice, "display_name": choice.get("display_name") or ckey,
                         "default": bool(choice.get("default")),
                         "kubevirt_override": _check_override(f"{where} choice {ckey}",
                                                              choice.get("kubevirt_override"))}
    if sum(c["default"] for c in choices.values()) > 1:
        raise ProfileError(f"{where} marks more than one choice as default")
    if choices and not any(c["default"] for c in choices.values()):
        next(iter(choices.values()))["default"] = True  # the first, as KubeSpawner does
    unlisted = dict(raw.get("unlisted_choice") or {})
    unlisted["enabled"] = bool(unlisted.get("enabled"))
    if unlisted["enabled"]:
        unlisted.setdefault("display_name", "Other")
        unlisted.setdefault("display_name_in_choices", "Other...")
        regex = unlisted.get("validation_regex") or ""
        try:
            re.compile(regex)
        except re.error as exc:
            raise ProfileError(f"{where}: unlisted_choice's validation_regex does not compile: {exc}") from None
        unlisted["validation_regex"] = regex
        unlisted["validation_message"] = unlisted.get("validation_message") or ""
        unlisted["kubevirt_override"] = _check_override(f"{where} unlisted_choice",
                                                        unlisted.get("kubevirt_override"))
    elif not choices:
        raise ProfileError(f"{where} has neither choices nor an enabled unlisted_choice")
    return {**raw, "display_name": raw.get("display_name") or key, "choices": choices, "unlisted_choice": unlisted}


def normalise(profiles) -> list[dict]:
    """Fill in slugs, defaults and versions and check the list (a list or KubeSpawner's dict);
    raise ProfileError naming the problem."""
    out, seen = [], set()
    for i, raw in enumerate(as_list(profiles)):
        if not isinstance(raw, dict) or not raw.get("display_name"):
            raise ProfileError(f"profile_list[{i}] needs a display_name")
        p = dict(raw)
        p["slug"] = p.get("slug") or slugify(p["display_name"])
        if p["slug"] in seen:
            raise ProfileError(f"profile_list has two profiles with the slug {p['slug']!r}")
        seen.add(p["slug"])
        where = f"profile_list[{i}] ({p['slug']})"
        p["kubevirt_override"] = _check_override(where, p.get("kubevirt_override"))
        options = p.get("profile_options") or {}
        if not isinstance(options, dict):
            raise ProfileError(f"{where}: profile_options must be a dict of options")
        p["profile_options"] = {key: _normalise_option(where, key, option) for key, option in options.items()}
        p["allowed_users"] = _names(where, "allowed_users", p.get("allowed_users"))
        p["allowed_groups"] = _names(where, "allowed_groups", p.get("allowed_groups"))
        p["version"] = str(p.get("version") or content_version(
            {"override": p["kubevirt_override"], "options": p["profile_options"]} if p["profile_options"]
            else p["kubevirt_override"]))
        out.append(p)
    if sum(1 for p in out if p.get("default")) > 1:
        raise ProfileError("profile_list marks more than one profile as default")
    return out


def content_version(override: dict) -> str:
    """A version that changes whenever the profile's settings change (a callable by its name, which
    is the same in every process)."""
    def stable(value):
        return getattr(value, "__qualname__", None) or type(value).__name__
    return hashlib.sha256(json.dumps(override, sort_keys=True, default=stable).encode()).hexdigest()[:10]


def may_use(profile: dict, user: str | None, groups: Iterable[str] = ()) -> bool:
    """Whether the user may start this profile: anyone, unless it names users or groups."""
    users, allowed_groups = profile.get("allowed_users"), profile.get("allowed_groups")
    if users is None and allowed_groups is None:
        return True
    return user in (users or ()) or bool(set(groups) & set(allowed_groups or ()))


def usable(profiles: list[dict], user: str | None, groups: Iterable[str] = ()) -> list[dict]:
    groups = tuple(groups)
    return [p for p in profiles if may_use(p, user, groups)]


def default_profile(profiles: list[dict]) -> dict | None:
    if not profiles:
        return None
    return next((p for p in profiles if p.get("default")), profiles[0])


def _single(name: str, value) -> str:
    """A value as one string: form data arrives as lists, JSON as whatever the client sent."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise ProfileError(f"The option {name!r} must be given as a single name." if name != "profile"
                           else "The profile must be given as a single name.")
    return value


def choose(profiles: list[dict], user_options: dict, user: str | None = None,
           groups: Iterable[str] = (), check_access: bool = True) -> Selection | None:
    """The profile and choices the user asked for. Anything the profile does not offer is refused
    with a sentence naming it: an unknown profile or option, a choice not listed, a value of one's
    own where none is allowed or that does not match, a profile the user may not use."""
    options = dict(user_options or {})
    slug = options.pop("profile", None)
    slug = None if slug is None else _single("profile", slug)
    if not profiles:
        if slug or options:
            what = f"profile {slug!r}" if slug else f"option(s) {', '.join(map(str, sorted(options)))}"
            raise ProfileError(f"Unknown {what}: this hub has no profiles.")
        return None
    offered = usable(profiles, user, groups) if check_access else profiles
    if not slug:
        profile = default_profile(offered)
        if profile is None:
            raise ProfileError(f"No profile of this hub is open to {user}: ask your administrator for one.")
    else:
        profile = next((p for p in profiles if p["slug"] == slug), None)
        if profile is None:
            raise ProfileError(f"Unknown profile {slug!r}. Choose one of: {', '.join(p['slug'] for p in offered)}.")
        if profile not in offered:
            others = ", ".join(p["slug"] for p in offered) or "none"
            raise ProfileError(f"The profile {slug!r} is not open to {user}: its administrator limits it to "
                               f"some users or groups. Profiles you may use: {others}.")
    return Selection(profile, _check_choices(profile, options))


def _check_choices(profile: dict, options: dict) -> dict:
    offered = profile["profile_options"]
    known = {key for key in offered} | {key + UNLISTED for key, o in offered.items() if o["unlisted_choice"]["enabled"]}
    extra = sorted(map(str, set(options) - known))
    if extra:
        can = ", ".join(sorted(known)) or "no options"
        raise ProfileError(f"Unsupported option(s) {', '.join(extra)} for the profile {profile['slug']!r}: it "
                           f"offers {can}; machine sizes come from the profiles your administrator defined.")
    chosen = {}
    for key, option in offered.items():
        own = options.get(key + UNLISTED)
        own = None if own is None else _single(key + UNLISTED, own)
        if own == "" and not options.get(key):
            raise ProfileError(f"The option {_label(key, option)} in the profile {profile['slug']!r} is empty: type a "
                               "value of your own, or pick one of the listed choices.")
        if own:  # a value of the user's own wins over a listed choice, as in KubeSpawner
            chosen[key + UNLISTED] = _check_unlisted(profile, key, option, own)
            continue
        choice = options.get(key)
        choice = None if choice is None else _single(key, choice)
        if choice:
            if choice not in option["choices"]:
                raise ProfileError(f"Unknown choice {choice!r} for {_label(key, option)} in the profile "
                                   f"{profile['slug']!r}. Choose one of: {', '.join(option['choices'])}.")
            chosen[key] = choice
        elif option["choices"]:
            chosen[key] = next(k for k, c in option["choices"].items() if c["default"])
        else:
            raise ProfileError(f"The option {_label(key, option)} in the profile {profile['slug']!r} needs a value "
                               f"(send it as {key + UNLISTED}).")
    return chosen


def _label(key: str, option: dict) -> str:
    return key if option["display_name"] == key else f"{option['display_name']} ({key})"


def _check_unlisted(profile: dict, key: str, option: dict, value: str) -> str:
    unlisted = option["unlisted_choice"]
    where = f"{_label(key, option)} in the profile {profile['slug']!r}"
    if len(value) > VALUE_MAX or not _PRINTABLE.match(value):
        raise ProfileError(f"The value for {where} must be at most {VALUE_MAX} printable characters.")
    # the whole value must match (KubeSpawner's re.match only anchors its start)
    if unlisted["validation_regex"] and not re.fullmatch(unlisted["validation_regex"], value):
        why = unlisted["validation_message"] or f"it must match {unlisted['validation_regex']}"
        raise ProfileError(f"The value {value!r} for {where} is not accepted: {why}")
    labels = _put_value(unlisted["kubevirt_override"], value).get("extra_labels")
    for label in labels.values() if isinstance(labels, dict) else ():
        if isinstance(label, str) and not _LABEL_VALUE.fullmatch(label):
            raise ProfileError(f"The value {value!r} for {where} cannot be used: it goes into a Kubernetes label, "
                               "which takes at most 63 letters, digits, '-', '_' or '.', beginning and ending "
                               "with a letter or digit.")
    return value


def overrides(selection: Selection) -> list[dict]:
    """The overrides to apply, in KubeSpawner's order: the profile's, then each option's (its
    choice's, the default choice's, or its unlisted choice's with the value put for `{value}`)."""
    out = [selection.profile["kubevirt_override"]]
    for key, option in selection.profile["profile_options"].items():
        if key + UNLISTED in selection.options:
            value = selection.options[key + UNLISTED]
            out.append(_put_value(option["unlisted_choice"]["kubevirt_override"], value))
        else:
            name = selection.options.get(key) or next(k for k, c in option["choices"].items() if c["default"])
            out.append(option["choices"][name]["kubevirt_override"])
    return out


def _put_value(template, value: str):
    """`{value}` replaced in every string of an override (not str.format: an admin's other braces,
    and the user's, stay as they are)."""
    if isinstance(template, str):
        return template.replace("{value}", value)
    if isinstance(template, dict):
        return {_put_value(k, value): _put_value(v, value) for k, v in template.items()}
    if isinstance(template, list):
        return [_put_value(v, value) for v in template]
    return template


def options_form(profiles: list[dict], user_options: dict | None = None, template: str = "") -> str:
    """JupyterHub's options form: a radio button per profile, a select per option (KubeSpawner's
    field names and classes), usable without script. `template`: an admin's Jinja2 template."""
    if not profiles:
        return ""
    user_options = dict(user_options or {})
    if not any(p["slug"] == user_options.get("profile") for p in profiles):
        user_options["profile"] = (default_profile(profiles) or {}).get("slug")
    form = FORM.from_string(template) if template else FORM.get_template("profiles_form.html")
    return form.render(profile_list=profiles, user_options=user_options, unlisted=UNLISTED_IN_FORM)


def options_from_form(formdata: dict) -> dict:
    """KubeSpawner's user_options from the form: `profile`, and the chosen profile's fields
    `profile-option-SLUG--OPTION` (a choice, or "unlisted-choice" for the field
    `profile-option-SLUG--OPTION--unlisted-choice`). Without script both fields arrive; the select
    says which counts."""
    slug = (formdata.get("profile") or [""])[0]
    if not slug:
        return {}
    out = {"profile": slug}
    prefix = f"profile-option-{slug}--"
    keys = {name[len(prefix):].removesuffix(UNLISTED) for name in formdata if name.startswith(prefix)}
    for key in sorted(keys):
        choice = (formdata.get(prefix + key) or [None])[0]
        own = (formdata.get(prefix + key + UNLISTED) or [None])[0]
        if choice == UNLISTED_IN_FORM or (choice is None and own is not None):  # (a script may drop the select)
            out[key + UNLISTED] = own or ""
        elif choice:
            out[key] = choice
    return out
