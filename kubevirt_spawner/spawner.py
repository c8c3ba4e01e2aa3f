"""KubeVirtSpawner: JupyterHub's Spawner API on top of `workstation/`.

The JupyterHub hooks only (the profile form, state, start, progress, poll, stop): the settings are
in `spawner_settings.py`, the machines they make in `spawner_machines.py`, the lifecycle in
`Workstation`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from datetime import datetime, timezone

from jupyterhub.spawner import Spawner
from jupyterhub.utils import maybe_future
from traitlets import default

from . import manifests as m
from . import profiles as prof
from .operations import defer_delete_during_operation, refuse_start_during_operation
from .service import SERVICE_NAME
from .spawner_machines import TEMPLATE_SETTINGS, SpawnerMachines, _shared, cpu_quantity
from .workstation import WorkstationError, refusals_explained, wait_synced

__all__ = ["KubeVirtSpawner", "TEMPLATE_SETTINGS", "cpu_quantity", "_shared"]


class KubeVirtSpawner(SpawnerMachines, Spawner):
    """Gives each user (each named server) a persistent KubeVirt VM whose root disk is an RBD volume."""

    # ---------------------------------------------------------------- set-up
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # (the settings checked there)
        self._progress: list[dict] = []
        self._start_began: str | None = None
        self._starting = False
        self._halting: asyncio.Future | None = None  # halting again after a post-stop halt failed

    # ---------------------------------------------------------------- options form
    @default("options_form")
    def _default_options_form(self):
        return self._render_options_form

    async def _render_options_form(self, spawner):
        """The profiles this user may start (a profile limited to others is not shown; a start
        naming it is refused too), with their last choices picked."""
        profiles = prof.usable(await self._profiles_now(), self.user.name, self._group_names())
        last = self.user_options or {}
        try:  # (saved options may be stale, or whatever the REST API was sent)
            prof.choose(profiles, last, self.user.name, self._group_names())
        except prof.ProfileError:
            last = {}
        return prof.options_form(profiles, last, self.profile_form_template)

    @default("options_from_form")
    def _default_options_from_form(self):
        return prof.options_from_form

    # ---------------------------------------------------------------- state
    def get_state(self):
        # The machine outlives its servers: JupyterHub's clear_state() between starts leaves these
        # names alone, so a workstation keeps its objects for life.
        state = super().get_state()
        if self._ident is not None:
            state["workstation"] = self._ident.to_state()
        return state

    def load_state(self, state):
        super().load_state(state)
        if state.get("workstation"):
            self._ident = m.Identity.from_state(state["workstation"])
            if not self._ident.user_created:  # (a state saved before the time was recorded)
                self._ident = dataclasses.replace(self._ident, user_created=self._user_created())
            self._current = None

    # ---------------------------------------------------------------- lifecycle
    def get_env(self):
        env = super().get_env()
        env["JUPYTERHUB_SERVICE_URL"] = f"http://0.0.0.0:{m.JUPYTER_PORT}{self.server.base_url if self.server else '/'}"
        if self.workstations_url:
            env["KUBEVIRT_WORKSTATIONS_URL"] = self.workstations_url
        page = self._workstations_page()
        if page:
            env["KUBEVIRT_WORKSTATIONS_PAGE"] = page
        return env

    def _workstations_page(self) -> str:
        """Where a browser finds the workstations service: with subdomains, JupyterHub gives each
        service a host of its own (NAME--service.HUB, its default subdomain_hook), which the
        guest cannot know; without, the path under the hub's base URL, which it can."""
        services = (getattr(self.user, "settings", None) or {}).get("services") or {}
        service = services.get(SERVICE_NAME)
        if service is None or not getattr(service, "host", ""):
            return ""
        return service.host + service.prefix

    async def start(self):
        self._progress = []
        self._start_began = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._starting = True
        try:
            if self._halting is not None and not self._halting.done():
                self._halting.cancel()  # (a stop on its way lands first: the client lets it)
                with contextlib.suppress(asyncio.CancelledError):
                    await self._halting
            selection = await self._selection(self.user_options)
            ws = await self._workstation(await self._spec_for(selection), for_start=True)
            with refusals_explained(self.log, "start"):
                await wait_synced(ws.caches, ws.log, self.k8s_api_retry_timeout, ws.ident.namespace)
            refuse_start_during_operation(ws)  # a restore or reset changes the machine now
            self.ip, self.port = "0.0.0.0", m.JUPYTER_PORT
            env = self.get_env()
            env.update(m.guest_env(ws.spec))  # (the profile's SSH setting and shared data, if it says)
            ws.log.info("starting for %s (profile %s)", self._log_name, ws.spec.profile or "-")
            url = await ws.start(env, self.get_args(), self._report)
            self._report(100, "Your workstation is ready")
            return url
        finally:
            self._starting = False
            self._wake_progress()

    def _report(self, percent: int, message: str):
        self._progress.append({"progress": percent, "message": message})
        self._wake_progress()

    def _wake_progress(self):
        """Wake this server's progress stream (it waits on changes in its namespace)."""
        self._shared()["caches"].notify(self._ident.namespace if self._ident else None)

    async def progress(self):
        """Our own steps, and the cluster's Events about this workstation since the start began."""
        shared = self._shared()
        caches = shared["caches"]
        sent, seen_events, percent = 0, set(), 0
        while True:
            while sent < len(self._progress):
                event = self._progress[sent]
                sent += 1
                percent = max(percent, event["progress"])
                yield event
            if self._ident is not None and self._start_began:
                ident = self._ident
                for ev in caches.events_for(ident.namespace, {ident.vm, ident.rootdisk, ident.workspace},
                                            (f"virt-launcher-{ident.vm}-",)):
                    key = (ev["metadata"].get("uid"), ev.get("count"), ev.get("lastTimestamp"))
                    stamp = ev.get("lastTimestamp") or ev.get("eventTime") or ""
                    if key in seen_events or stamp < self._start_began:
                        continue
                    seen_events.add(key)
                    yield {"progress": percent, "message": f"{ev.get('reason')}: {ev.get('message')}"}
            if not self._starting:
                return
            await caches.next_change(namespace=self._ident.namespace if self._ident else None)

    async def poll(self):
        if self._starting:
            return None
        try:
            ws = await self._workstation()
            # Never report a running machine as stopped before the caches know.
            with refusals_explained(self.log, "be checked"):
                await wait_synced(ws.caches, ws.log, self.k8s_api_retry_timeout, ws.ident.namespace)
        except WorkstationError as err:
            self.log.warning("cannot tell whether the workstation of %s runs (%s): reporting it as running",
                             self._log_name, err.reason)
            return None
        status = ws.status()
        if status in ("running", "starting"):
            return None
        if status == "lost":
            ws.log.warning("on a node that stopped responding: reporting %s as not running", self._log_name)
            return 1
        return 1 if status == "failed" else 0

    async def get_url(self):
        ws = await self._workstation()
        return ws.url() or await super().get_url()

    async def stop(self, now=False):
        ws = await self._workstation()
        await ws.stop(now=now)

    async def run_post_stop_hook(self):
        """JupyterHub skips stop() when poll() already says "not running" (the guest powered off or
        crashed, or its node was lost); halt the VM then, so it does not restart behind the hub."""
        try:
            ws = await self._workstation()
            await ws.ensure_halted()
        except Exception:
            self.log.exception("could not make sure the workstation of %s stays stopped; trying again until it "
                               "does or the server starts", self._log_name)
            if self._halting is None or self._halting.done():
                self._halting = asyncio.ensure_future(self._halt_until_done())  # (start() cancels it)
        return await maybe_future(super().run_post_stop_hook())

    async def _halt_until_done(self, first_delay: float = 5.0):
        """Halt the VM again and again (with backoff, at most a minute apart) until it lands: with
        virt-api down for minutes, a VM left to run (runStrategy Always) comes back by itself when
        its lost node is fenced, with no server in the hub."""
        delay = first_delay
        while True:
            await asyncio.sleep(delay)
            try:
                await (await self._workstation()).ensure_halted()
            except Exception as exc:
                delay = min(delay * 2, 60.0)
                self.log.warning("still cannot make sure the workstation of %s stays stopped (%s); trying again in "
                                 "%.0f s", self._log_name, exc, delay)
                continue
            self.log.info("the workstation of %s stays stopped now", self._log_name)
            return

    async def delete_forever(self):
        ws = await self._workstation()
        with refusals_explained(self.log, "be deleted"):
            await wait_synced(ws.caches, ws.log, self.k8s_api_retry_timeout, ws.ident.namespace)
        try:
            await defer_delete_during_operation(ws)  # a restore or reset deletes it when it ends
        except WorkstationError as err:
            # JupyterHub forgets the server whatever this does (a raise would only add its traceback
            # to the hub's log): the sentence, for the admin, is the log line.
            ws.log.warning("not deleted now: %s", err.jupyterhub_message)
            return
        kept = await ws.retire()
        ws.log.info("deleted the workstation of %s; kept %s", self._log_name, ", ".join(kept))
