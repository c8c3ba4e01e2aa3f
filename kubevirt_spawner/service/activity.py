"""Why a running workstation counts as busy, and when the idle culler would stop it: the guests'
activity reports, the keep-alives users ask for (reported to the hub as activity while they
last), and the SSH sessions the guests report."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from . import times
from .access import Access, Caller, ServiceError, workstation_path
from .hub import Hub, HubError

if TYPE_CHECKING:
    from .audit import Audit
    from .settings import WorkstationsSettings

# What a guest may name as the reason it is busy (kubevirt_spawner.guest.activity's sources); a
# keep-alive is the service's own, never the guest's word.
ACTIVITY_SOURCES = ("jupyter", "ssh", "console", "gpu", "cpu", "kernel", "ssh-tunnel")
# A guest's report older than this many of its own intervals is stale (the guest stopped reporting).
REPORT_STALE_INTERVALS = 3


def check_activity_report(sources, every) -> None:
    """A guest's activity report: at most 20 `{"source", "text", "since"}` and its interval. Every
    field is bounded (the service keeps the last report of every workstation in memory)."""
    if not isinstance(sources, list) or len(sources) > 20 or not all(
            isinstance(x, dict) and x.get("source") in ACTIVITY_SOURCES and isinstance(x.get("text"), str)
            and len(x["text"]) <= 300 and _time_or_none(x.get("since")) for x in sources):
        raise ServiceError(400, '"sources" is a list of at most 20 {"source": one of '
                                f'{", ".join(ACTIVITY_SOURCES)}, "text": "...", "since": time or null}}.')
    if not isinstance(every, (int, float)) or isinstance(every, bool) or not 1 <= every <= 3600:
        raise ServiceError(400, '"every" is the number of seconds until the next report, 1 to 3600.')


def _time_or_none(value) -> bool:
    return value is None or (isinstance(value, str) and len(value) <= 40 and times.parse_time(value) is not None)


class Activity:
    """Per workstation (user, server): the keep-alive's end, and the guest's last report."""

    def __init__(self, settings: WorkstationsSettings, hub: Hub, access: Access, audit: Audit,
                 log: logging.Logger | logging.LoggerAdapter):
        self.settings = settings
        self.hub = hub
        self.access = access
        self.audit = audit
        self.log = log
        self.keepalives: dict[tuple[str, str], datetime] = {}
        self.reports: dict[tuple[str, str], dict] = {}  # the guest's last word on why it is busy

    def forget(self, user: str, server: str) -> None:
        """The machine stopped: its keep-alive ends, and its guest's last word is about a machine
        that is gone."""
        self.keepalives.pop((user, server), None)
        self.reports.pop((user, server), None)

    # ---------------------------------------------------------------- what callers ask
    async def keepalive(self, caller: Caller, user: str, server: str, minutes) -> dict:
        ws = await self.access.existing(caller, user, server)
        if not isinstance(minutes, int) or isinstance(minutes, bool) or minutes < 1:
            raise ServiceError(400, 'Say for how many minutes to keep the workstation running ("minutes": 60).')
        if minutes > self.settings.keepalive_max_minutes:
            raise ServiceError(400, f"A keep-alive lasts at most {self.settings.keepalive_max_minutes} minutes.")
        if ws.status() not in ("running", "starting"):
            raise ServiceError(409, "The workstation is not running; start it first.")
        until = times.now() + timedelta(minutes=minutes)
        await self.hub.record_activity(user, server, times.now())
        self.keepalives[(user, server)] = until
        self.audit.of(caller, "keepalive", ws, "ok", f"{minutes} min")
        return {"keepalive_until": times.iso(until)}

    async def report(self, caller: Caller, user: str, server: str, sources, every) -> dict:
        """What the guest says keeps its machine busy (logins with recent input, a busy GPU, ...),
        shown as the reason it counts as active; `every`: seconds until its next report. The hub's
        last_activity, which the culler reads, moves through JupyterHub's own activity report; this
        is the why."""
        await self.access.existing(caller, user, server)
        check_activity_report(sources, every)
        at = times.now()
        self.reports[(user, server)] = {"at": at, "every": every, "sources": [
            {"source": x["source"], "text": x["text"], "since": times.iso_or_none(times.parse_time(x.get("since")))}
            for x in sources]}
        return {"recorded": times.iso(at)}

    async def report_keepalives(self) -> None:
        """Every keepalive_interval: activity for the servers whose keep-alive lasts."""
        while True:
            # (and at the earliest end: its activity is recorded then, not up to an interval later)
            ends = [(until - times.now()).total_seconds() for until in self.keepalives.values()]
            await asyncio.sleep(max(0.1, min([self.settings.keepalive_interval, *ends])))
            now = times.now()
            for key, until in list(self.keepalives.items()):
                if until <= now and self.keepalives.get(key) == until:  # (not renewed or stopped meanwhile)
                    # the end of the keep-alive is its last activity: the timeout runs from there
                    del self.keepalives[key]
                try:
                    await self.hub.record_activity(*key, min(until, now))
                except HubError as err:
                    self.log.warning("keep-alive of %s: the hub refused the activity: %s", workstation_path(*key), err)
                except Exception:  # one workstation's trouble must not end the keep-alives of all
                    self.log.exception("keep-alive of %s failed", workstation_path(*key))

    # ---------------------------------------------------------------- views
    def why_active(self, user: str, server: str, hub_server: dict, keepalive: datetime | None,
                   now: datetime | None = None) -> dict:
        """Why the running machine counts as busy (its guest's last report, unless stale, and a
        keep-alive), or since when it is idle (the hub's last activity) when nothing does."""
        now = now or times.now()
        reported = self._fresh_report(user, server, now)
        sources = list(reported["sources"]) if reported else []
        if keepalive and keepalive > now:
            sources.append({"source": "keepalive", "text": f"kept running until {times.iso(keepalive)}",
                            "since": None})
        return {"reported": times.iso(reported["at"]) if reported else None, "sources": sources,
                "idle_since": None if sources else times.iso_or_none(times.parse_time(hub_server.get("last_activity")))}

    def _fresh_report(self, user: str, server: str, now: datetime) -> dict | None:
        """The guest's last activity report, unless it stopped reporting (its last word no longer holds)."""
        reported = self.reports.get((user, server))
        if reported and now - reported["at"] > timedelta(seconds=REPORT_STALE_INTERVALS * reported["every"]):
            return None
        return reported

    def ssh_sessions(self, now: datetime | None = None) -> list[dict]:
        """The workstations with someone on SSH, as their guests last reported: a tunnel through
        the hub (a VS Code window, scp) or a login with a terminal."""
        now = now or times.now()
        out = []
        for user, server in sorted(self.reports):
            reported = self._fresh_report(user, server, now)
            for x in reported["sources"] if reported else []:
                if x["source"] in ("ssh-tunnel", "ssh"):
                    out.append({"user": user, "server": server, "text": x["text"], "since": x["since"]})
        return out

    def idle(self, server: dict | None, keepalive: datetime | None) -> dict | None:
        """When the idle culler would stop the running server: the timeout after its last activity,
        or after the end of a keep-alive. None without idle stops or a running server."""
        timeout = self.settings.idle_timeout
        if not timeout or not server or not server.get("ready"):
            return None
        last = times.parse_time(server.get("last_activity"))
        if last is None:
            return None
        # a keep-alive reports activity until it ends: the timeout runs from then
        deadline = max(last, keepalive or last) + timedelta(seconds=timeout)
        return {"timeout_seconds": timeout, "last_activity": times.iso(last), "deadline": times.iso(deadline),
                "warn_at": times.iso(deadline - timedelta(seconds=self.settings.idle_warn_before)),
                "warn_before_seconds": self.settings.idle_warn_before,
                # (by the service's clock, for a client whose own clock may be off)
                "stop_in_seconds": max(0, round((deadline - times.now()).total_seconds())),
                "check_every_seconds": self.settings.idle_cull_every or None}
