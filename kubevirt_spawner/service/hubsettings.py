"""The hub's KubeVirtSpawner settings in the service's process: the spawner of any workstation,
made as the hub makes it (names, profiles, images), and the hub-wide API client's caches.

The service is not the hub: it has no JupyterHub User nor the database's record of a server. A
spawner gets typed stand-ins for the two, with the fields KubeVirtSpawner reads."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from traitlets.config import Config

from .. import manifests as m
from ..reflector import Caches
from ..spawner import KubeVirtSpawner
from ..workstation import Workstation


@dataclass(frozen=True)
class ServiceUser:
    """A hub user as the service knows them: by name. No groups and no auth state (a callable
    profile_list asked for them sees none), no account time (the disks keep the one they have)."""
    name: str
    groups: list[Any] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"/user/{self.name}/"

    async def get_auth_state(self) -> None:
        return None


@dataclass(frozen=True)
class ServerRecord:
    """The database's record of a server (JupyterHub's orm.Spawner), as the service has it: its
    name only; no server running in this process, no saved state or options."""
    name: str
    display_name: str = ""
    server: None = None
    state: None = None
    user_options: None = None


def recorded_options(text: str | None) -> dict:
    """The user's choices in the profile as the VM records them; anything else is no choice (the
    spawner checks them against the profile again)."""
    try:
        options = json.loads(text or "{}")
    except ValueError:
        return {}
    return {k: v for k, v in options.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(options, dict) else {}


class HubSettings:
    """The hub's config as the spawner reads it; the service's only way to its workstations."""

    def __init__(self, config: Config, log: logging.Logger | logging.LoggerAdapter):
        self.config = config
        self.log = log

    @cached_property
    def _hub_spawner(self) -> KubeVirtSpawner:
        """A spawner of no user's: the settings alone, and the client and caches they share
        (made on first use: a bad setting is then a refused request, as before)."""
        return KubeVirtSpawner(config=self.config, log=self.log)

    @property
    def caches(self) -> Caches:
        """The caches of the hub-wide API client (started on first use)."""
        caches: Caches = self._hub_spawner._shared()["caches"]
        return caches

    def spawner(self, user: str, server: str) -> KubeVirtSpawner:
        """A spawner for the server, with the hub's own settings (names, profiles, images)."""
        return KubeVirtSpawner(config=self.config, log=self.log, orm_spawner=ServerRecord(server),
                               user=ServiceUser(user))

    async def workstation(self, user: str, server: str) -> Workstation:
        """The lifecycle object of user/server with the spec of the profile it runs with."""
        spawner = self.spawner(user, server)
        ws = await spawner.workstation()
        annotations = (ws.vm or {}).get("metadata", {}).get("annotations") or {}
        slug = annotations.get(m.ANNOTATION_PROFILE)
        options = recorded_options(annotations.get(m.ANNOTATION_PROFILE_OPTIONS))
        if slug and (slug != ws.spec.profile or options):
            ws = await spawner.workstation(slug, options)
        return ws

    def all_workstations(self) -> list[tuple[str, str]]:
        """(user, server) of every workstation in the cluster, from the VMs' annotations."""
        out = set()
        for vm in self.caches.vms.values():
            ann = vm["metadata"].get("annotations") or {}
            if m.LABEL_WORKSTATION in (vm["metadata"].get("labels") or {}) and ann.get(m.ANNOTATION_USERNAME):
                out.add((ann[m.ANNOTATION_USERNAME], ann.get(m.ANNOTATION_SERVERNAME, "")))
        return sorted(out)
