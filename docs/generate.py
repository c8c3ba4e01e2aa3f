"""Writes the pages of docs/ that come from the code: the configuration reference, from the
traitlets of the classes a site configures, and the failures a user can meet, from
`kubevirt_spawner.reasons.Reason`. `python docs/generate.py` after changing a setting or a reason;
tests/test_docs.py fails when a page here differs from what this makes, or a setting has no help."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

DOCS = Path(__file__).resolve().parent

# (class, where it is configured, what it is): the classes a site's config file sets
CONFIGURABLES = (
    ("kubevirt_spawner.spawner", "KubeVirtSpawner", "the hub's config (`jupyterhub_config.py`)",
     "The spawner: the workstation each user gets, its profiles, disks, placement and namespace."),
    ("kubevirt_spawner.service.core", "Workstations", "the hub's config (the service loads the same file)",
     "The workstations service: snapshots, restore, reset, idle stops, keep-alives, drains, costs."),
    ("kubevirt_spawner.guest.activity", "WorkstationActivity", "the workstation's Jupyter server config",
     "What counts as activity inside a workstation (kernels, terminals, SSH, the GPU)."),
    ("kubevirt_spawner.guest.proxy", "WorkstationGuest", "the workstation's Jupyter server config",
     "The workstation's side of the Lab panel and the SSH tunnel."),
)


def settings_of(cls) -> dict:
    """The settings a class of this package defines: its own and its bases' (KubeVirtSpawner's are
    in KubeVirtSpawnerSettings), not those it inherits from JupyterHub or traitlets."""
    def owner(name: str):
        return next(c for c in cls.__mro__ if name in vars(c))
    return {name: trait for name, trait in cls.class_traits(config=True).items()
            if owner(name).__module__.startswith("kubevirt_spawner")}


def _class(module: str, name: str):
    __import__(module)
    return getattr(sys.modules[module], name)


def _help(text: str) -> str:
    return textwrap.dedent(text or "").strip()


def configuration() -> str:
    out = ["# Configuration reference", "",
           "Generated from the code by `python docs/generate.py`; a test fails when this page and the code "
           "differ, so edit the settings' help in the code, not here.", ""]
    for module, name, where, what in CONFIGURABLES:
        cls = _class(module, name)
        out += [f"## {name}", "", f"{what} Set in {where} as `c.{name}.SETTING`.", ""]
        for trait_name, trait in sorted(settings_of(cls).items()):
            default = trait.default_value_repr()
            if len(default) > 120:
                default = default[:117] + "..."
            out += [f"### `c.{name}.{trait_name}`", "",
                    f"{type(trait).__name__}, default `{default}`", "", _help(trait.help), ""]
    return "\n".join(out).rstrip() + "\n"


def failures() -> str:
    from kubevirt_spawner.reasons import Reason
    out = ["# Failures", "",
           "Generated from the code by `python docs/generate.py`; a test fails when this page and the code "
           "differ, so edit the descriptions in `kubevirt_spawner/reasons.py`, not here.", "",
           "A start, snapshot, restore or reset that fails in a way the user can act on shows them one sentence "
           "that says what happened and what to do, and carries a short reason: the hub's log shows it, and "
           "JupyterHub's spawn-failure metrics label a failed start with it (`reason`).", "",
           "| Reason | When, and what to do |", "| --- | --- |"]
    out += [f"| `{reason.value}` | {reason.description.replace('|', '&#124;')} |" for reason in Reason]
    return "\n".join(out) + "\n"


PAGES = {"configuration.md": configuration, "failures.md": failures}


def missing_help() -> list[str]:
    """The configurable settings without help text: each needs a sentence for the reference."""
    out = []
    for module, name, _, _ in CONFIGURABLES:
        cls = _class(module, name)
        out += [f"{name}.{t}" for t, trait in settings_of(cls).items() if not _help(trait.help)]
    return out


def main() -> int:
    for page, make in PAGES.items():
        (DOCS / page).write_text(make())
        print(f"wrote {DOCS / page}")
    if missing_help():
        print("settings without help: " + ", ".join(missing_help()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
