"""The design document's production acceptance experiments (its section 13), run against a hub.

One `Suite` walks a test user's workstation through the promises in order: placed on its pool;
what the user changes survives a stop and a start; a stop frees CPU, memory and GPU and keeps the
disks; other users cannot reach it; snapshots and restores work; a reset keeps the workspace; an
idle machine is warned, then stopped; a deleted named server keeps its disks. Each experiment ends
as one Record: PASS, FAIL or SKIP with one sentence and its figures. What the suite made goes at
the end (its workstations stopped and deleted; their kept disks purged where the retention allows,
else listed)."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

from .base import EXPERIMENTS, NEEDED_SCOPES, Options, Skip
from .client import AcceptanceError, workstation_name
from .host import HostExperiments
from .persistence import PersistenceExperiments
from .report import PASS, Record
from .security import SecurityExperiments
from .storage import StorageExperiments

__all__ = ["EXPERIMENTS", "Options", "Skip", "Suite"]  # (what callers and subclasses import from here)


class Suite(HostExperiments, PersistenceExperiments, SecurityExperiments, StorageExperiments):
    """The experiments of every section, run in the report's order, and the clean-up at the end."""

    async def run(self) -> list[Record]:
        me = await self.t.hub.whoami()
        lacking = [s for s in NEEDED_SCOPES if s not in (me.get("scopes") or [])]
        if lacking and not me.get("admin"):
            raise AcceptanceError("The suite makes its own test users and workstations and acts as them: give a hub "
                                  f"admin's token (it lacks {', '.join(lacking)}).")
        if self.o.destructive and self.wants("storage"):
            await self.check_node_to_lose()
        if self.wants("host"):
            await self.host_checks()
        sections = [s for s in ("persistence", "storage", "security") if self.wants(s)]
        if not sections and not self.wants("host"):
            return self.records
        if await self.t.ensure_user(self.user):
            self.made.users.append(self.user)
        else:  # (a user of the hub's: the users the run adds are named apart from any of theirs)
            self.helpers = f"{self.user}-{self.tag}"
        try:
            start = await self.experiment("persistence", "first-start", self.first_start)
            if start.result != PASS:  # (nothing else can be shown without it)
                done = {(r.section, r.name) for r in self.records}
                for section in [s for s in EXPERIMENTS if self.wants(s)]:
                    self.skipped(section, [n for n in EXPERIMENTS[section] if (section, n) not in done],
                                 f"The first start failed: {start.sentence}")
                return self.records
            if self.wants("host"):
                await self.experiment("host", "placement", self.placement)
            if self.wants("persistence"):
                await self.persistence()
            if self.wants("security"):
                await self.security()
            if self.wants("storage"):
                await self.storage()
            if self.wants("persistence"):
                await self.experiment("persistence", "reset-keeps-workspace", self.reset_keeps_workspace)
            if self.wants("security"):
                await self.experiment("security", "idle-warning-then-stop", self.idle_warning_then_stop)
            if self.wants("persistence"):
                await self.experiment("persistence", "deleted-server-keeps-disks", self.deleted_server_keeps_disks)
        finally:
            await self.clean_up()
        return self.records

    # ------------------------------------------------------------ the end
    async def clean_up(self):
        """Stop and delete what the suite made; its kept disks are purged where their retention
        allows, else listed (a disk is never deleted before its retention ends). Each step on its
        own: one that fails is listed, and the rest still go."""
        left: list[str] = []

        async def step(what: str, work) -> Any:
            try:
                return await work
            except Exception as err:  # (the clean-up goes on; what is left is said at the end)
                left.append(f"{what} ({type(err).__name__}: {str(err)[:120]})")
                return None

        for user, (_, token_id) in self.made.tokens.items():
            await step(f"revoking {user}'s token", self.t.revoke_token(user, token_id))
        for user, name, snap in self.made.snapshots:
            path = self.t.workstation_path(user, name) + f"/snapshots/{snap}"
            await step(f"snapshot {snap} of {workstation_name(user, name)}", self.t.service("DELETE", path))
        for user, server in self.made.servers:
            await step(f"stopping {workstation_name(user, server)}", self.t.stop(user, server, self.o.start_timeout))
            if server:
                await step(f"deleting {workstation_name(user, server)}", self.t.delete_server(user, server))
        for user in self.made.users:
            await step(f"deleting the user {user}", self.t.api("DELETE", f"users/{quote(user, safe='')}"))
        kept = []
        for user, server in self.made.servers:
            retained = None
            for _ in range(30):  # (the spawner marks them retained as the server or user goes)
                retained = await step(f"the kept disks of {workstation_name(user, server)}", self.retained(user, server))
                if retained or retained is None:
                    break
                await asyncio.sleep(2)
            if not retained:
                continue
            answer = await step(f"purging {workstation_name(user, server)}",
                                self.t.service("POST", self.t.workstation_path(user, server) + "/purge",
                                               {"confirm": user}))
            if not answer or answer[0] != 200:
                kept.append(f"{workstation_name(user, server)} until "
                            f"{max(r.get('retain_until') or '?' for r in retained)}")
        if kept:
            print(f"Kept (retention): the disks of {', '.join(kept)}; purge them then from the admin page.",
                  file=self.out, flush=True)
        if left:
            print(f"Not cleaned up: {'; '.join(left)}.", file=self.out, flush=True)
