"""Profiles: named machine shapes a user picks from, in the spirit of KubeSpawner's profile_list.

Each profile is a dict with `display_name`, optional `slug`, `description`, `default`, `version`
and `kubevirt_override` (spawner settings it changes). Pure functions only.
"""

from __future__ import annotations

import hashlib
import html
import json
import re

# The settings a profile may change (names of KubeVirtSpawner traits).
OVERRIDABLE = {"cpu_guarantee", "cpu_limit", "mem_guarantee", "mem_limit", "memory_guest", "gpus", "node_selector",
               "tolerations", "affinity", "root_disk_size", "golden_image", "workspace_disk_size", "storage_class",
               "extra_labels", "extra_annotations", "termination_grace_period", "firmware", "ssh_enabled"}


class ProfileError(ValueError):
    """A profile choice or a profile_list that cannot be used; the text says why."""


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "profile"


def normalise(profiles: list[dict]) -> list[dict]:
    """Fill in slugs and versions and check the list; raise ProfileError naming the problem."""
    out, seen = [], set()
    for i, raw in enumerate(profiles):
        if not isinstance(raw, dict) or not raw.get("display_name"):
            raise ProfileError(f"profile_list[{i}] needs a display_name")
        p = dict(raw)
        p["slug"] = p.get("slug") or slugify(p["display_name"])
        if p["slug"] in seen:
            raise ProfileError(f"profile_list has two profiles with the slug {p['slug']!r}")
        seen.add(p["slug"])
        override = p.get("kubevirt_override") or {}
        unknown = sorted(set(override) - OVERRIDABLE)
        if unknown:
            raise ProfileError(f"profile_list[{i}] ({p['slug']}): kubevirt_override cannot set "
                               f"{', '.join(unknown)}; allowed: {', '.join(sorted(OVERRIDABLE))}")
        p["kubevirt_override"] = override
        p["version"] = str(p.get("version") or content_version(override))
        out.append(p)
    if sum(1 for p in out if p.get("default")) > 1:
        raise ProfileError("profile_list marks more than one profile as default")
    return out


def content_version(override: dict) -> str:
    """A version that changes whenever the profile's settings change."""
    return hashlib.sha256(json.dumps(override, sort_keys=True, default=str).encode()).hexdigest()[:10]


def default_profile(profiles: list[dict]) -> dict | None:
    if not profiles:
        return None
    return next((p for p in profiles if p.get("default")), profiles[0])


def choose(profiles: list[dict], user_options: dict) -> dict | None:
    """The profile the user asked for; refuse unknown profiles and any other option."""
    options = dict(user_options or {})
    extra = sorted(set(options) - {"profile"})
    if extra:
        raise ProfileError(f"Unsupported option(s) {', '.join(extra)}: only 'profile' can be chosen; machine sizes "
                           "come from the profiles your administrator defined.")
    slug = options.get("profile")
    if isinstance(slug, list):  # form data arrives as lists
        slug = slug[0] if len(slug) == 1 else slug
    if not profiles:
        if slug:
            raise ProfileError(f"Unknown profile {slug!r}: this hub has no profiles.")
        return None
    if slug is None or slug == "":
        return default_profile(profiles)
    if not isinstance(slug, str):
        raise ProfileError("The profile must be given as a single name.")
    for p in profiles:
        if p["slug"] == slug:
            return p
    raise ProfileError(f"Unknown profile {slug!r}. Choose one of: {', '.join(p['slug'] for p in profiles)}.")


def options_form(profiles: list[dict], current: str | None = None) -> str:
    """JupyterHub options form: one radio button per profile."""
    if not profiles:
        return ""
    chosen = current or (default_profile(profiles) or {}).get("slug")
    rows = []
    for p in profiles:
        slug = html.escape(p["slug"], quote=True)
        checked = " checked" if p["slug"] == chosen else ""
        desc = f'<div class="profile-description">{html.escape(p.get("description") or "")}</div>' \
            if p.get("description") else ""
        rows.append(f'<label class="profile-option" for="profile-{slug}">'
                    f'<input type="radio" name="profile" id="profile-{slug}" value="{slug}"{checked}> '
                    f'<strong>{html.escape(p["display_name"])}</strong>{desc}</label>')
    return '<div class="kubevirt-profiles">' + "".join(rows) + "</div>"


def options_from_form(formdata: dict) -> dict:
    values = formdata.get("profile") or []
    return {"profile": values[0]} if values else {}
