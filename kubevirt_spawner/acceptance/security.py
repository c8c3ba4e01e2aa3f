"""The acceptance suite's security and product-experience experiments: another user is refused, the
VMI's own address refuses without a token, no cluster credentials in the guest, the user sees usage
and snapshots, and an idle machine is warned, then stopped."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from . import guest
from .base import Skip, SuiteBase
from .client import AcceptanceError
from .report import FAIL, PASS


class SecurityExperiments(SuiteBase):
    """Security and product experience: who is refused, what the guest holds, what the user sees."""

    async def security(self):
        async def other_user_refused():
            return await self.other_user_refused(await self.token_of(await self.new_user(f"{self.helpers}-other")))
        await self.experiment("security", "other-users-are-refused", other_user_refused)
        await self.experiment("security", "vmi-address-refuses-without-token", self.vmi_address_refuses)
        await self.experiment("security", "no-cluster-credentials-in-guest", self.no_credentials)
        await self.experiment("security", "usage-and-snapshots-visible-to-user", self.visible_to_user)

    async def other_user_refused(self, token: str):
        """Another user's token: the workstation's Jupyter, the service's view and actions on it and
        its SSH tunnel all refuse, and nothing changed."""
        url = await self.t.url_of(self.user, self.server)
        path = self.t.workstation_path(self.user, self.server)
        before = len((await self.t.service("GET", path + "/snapshots"))[1].get("snapshots") or [])
        answers: dict[str, Any] = {
            "jupyter": (await self.t.as_user(token, "GET", url + "api/contents"))[0],
            "service view": (await self.t.service("GET", path, token=token))[0],
            "service snapshot": (await self.t.service("POST", path + "/snapshots", {"name": "acc-intruder"},
                                                      token=token))[0],
            "service reset": (await self.t.service("POST", path + "/reset", {"confirm": self.name}, token=token))[0],
            "service stop": (await self.t.service("POST", path + "/stop", {"wait": False}, token=token))[0],
        }
        try:
            ws = await self.t.session.ws_connect(url + "sshd/", headers={"Authorization": f"token {token}"},
                                                 timeout=aiohttp.ClientWSTimeout(ws_close=10))
            await ws.close()
            answers["ssh tunnel"] = 101
        except aiohttp.WSServerHandshakeError as refused:
            answers["ssh tunnel"] = refused.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            answers["ssh tunnel"] = f"no connection ({type(err).__name__})"
        if 200 <= answers["service snapshot"] < 300:  # (let in: it goes with the rest at the end)
            self.made.snapshots.append((self.user, self.server, "acc-intruder"))
        after = (await self.t.service("GET", path + "/snapshots"))[1].get("snapshots") or []
        owner = await self.token_of(self.user)
        controls = {"jupyter": (await self.t.as_user(owner, "GET", url + "api/contents"))[0],
                    "service view": (await self.t.service("GET", path, token=owner))[0]}
        if any(v != 200 for v in controls.values()):
            return FAIL, f"The owner's own token was not let in either ({controls}): the refusals show nothing.", \
                {**answers, **{f"owner {k}": v for k, v in controls.items()}}
        let_in = [k for k, v in answers.items() if isinstance(v, int) and (200 <= v < 300 or v == 101)]
        still = (await self.t.server_model(self.user, self.server) or {}).get("ready")
        if let_in:
            return FAIL, f"Another user's token was let in: {', '.join(let_in)}.", answers
        if len(after) != before or not still:
            return FAIL, "Another user's requests changed the workstation (a snapshot, or a stop).", answers
        return PASS, "Another user's token is refused by the workstation's Jupyter, the service and the SSH tunnel.", answers

    async def vmi_address_refuses(self):
        """Straight to the VMI's address, past the hub and the proxy, without a token: refused (or
        not reachable at all, as network policies make it)."""
        if not self.has_cluster:
            raise Skip("Give --kubeconfig to learn the VMI's address.")
        _, vmi = await self.vm_and_vmi()
        ip = next((i.get("ipAddress") for i in (vmi or {}).get("status", {}).get("interfaces") or [] if i.get("ipAddress")),
                  None)
        if not ip:
            raise AcceptanceError("The VMI reports no address.")
        url = await self.t.url_of(self.user, self.server)
        prefix = "/" + url.split("://", 1)[1].split("/", 1)[1] if "/" in url.split("://", 1)[1] else "/"
        direct = f"http://{ip}:8888{prefix}api/contents"
        try:
            async with self.t.session.get(direct, allow_redirects=False,
                                          timeout=aiohttp.ClientTimeout(total=10)) as r:
                answer: Any = r.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            answer = f"no connection ({type(err).__name__})"
        figures = {"address": f"{ip}:8888", "answer": answer}
        if isinstance(answer, int) and 200 <= answer < 300:
            return FAIL, f"The VMI's own address {ip}:8888 served the workstation's files without a token.", figures
        if not isinstance(answer, int):
            raise Skip(f"The VMI's address {ip}:8888 cannot be reached from here ({answer}); run the suite from "
                       "inside the cluster's network to see it refuse.")
        if answer not in (401, 403) and not 300 <= answer < 400:  # (a refusal, or a redirect to the hub's login)
            return FAIL, (f"The VMI's own address answered {answer}, which is no refusal: the workstation's Jupyter "
                          "did not answer there as it does through the hub, so nothing was shown."), figures
        return PASS, f"The VMI's own address answered {answer} without a token.", figures

    async def no_credentials(self):
        found = await self.t.guest_json(self.user, self.server, guest.credentials_scan(), timeout=900)
        figures = {"files scanned": found.get("scanned"), "hub token known": found.get("had_token")}
        problems = list(found.get("found") or [])
        if found.get("kube_env"):
            problems.append("environment variables " + ", ".join(found["kube_env"]))
        if problems:
            return FAIL, "Credentials the guest must not hold: " + "; ".join(problems[:5]) + ".", figures
        if not found.get("had_token"):
            return FAIL, "The kernel had no hub API token to look for: nothing was proven.", figures
        return PASS, ("No ServiceAccount token, no kubeconfig, and the hub's API token nowhere outside the runtime "
                      "tmpfs."), figures

    async def visible_to_user(self):
        """What the user sees in the Lab panel (the service's status, with the user's own token):
        disk usage with its level, snapshot count, limit and retention, quota."""
        token = await self.token_of(self.user)
        deadline = time.monotonic() + 120
        while True:  # the guest agent reports usage a little after a boot
            view = await self.t.status(self.user, self.server, token=token)
            root = (view.get("disks") or {}).get("root") or {}
            if root.get("percent") is not None or time.monotonic() > deadline:
                break
            await asyncio.sleep(3)
        snaps = view.get("snapshots") or {}
        figures = {"root size": root.get("size"), "root used %": root.get("percent"), "level": root.get("level"),
                   "snapshots": snaps.get("count"), "snapshot limit": snaps.get("limit"),
                   "quota": [q.get("name") for q in view.get("quota") or []] if view.get("quota") else None,
                   "cost": (view.get("cost") or {}).get("month_to_date") if isinstance(view.get("cost"), dict) else None}
        missing = [k for k, v in (("disk usage", root.get("percent")), ("usage level", root.get("level")),
                                  ("snapshot count", snaps.get("count")), ("snapshot retention", snaps.get("retention")))
                   if v is None]
        if missing:
            return FAIL, f"The user's status lacks: {', '.join(missing)}.", figures
        return PASS, "The user sees the disk usage and its level, the snapshot count, limit and retention.", figures

    async def idle_warning_then_stop(self):
        """The idle culler's stop comes after the Lab's warning, and the disks stay."""
        view = await self.t.status(self.user, self.server)
        idle = view.get("idle")
        if not idle:
            raise Skip("The hub stops no idle workstation (no idle culler), or the workstation does not run.")
        timeout = idle.get("timeout_seconds") or 0
        if timeout > self.o.idle_wait:
            raise Skip(f"The idle timeout is {timeout} s, longer than --idle-wait {self.o.idle_wait:.0f}: run with "
                       f"--idle-wait {timeout + 300} to watch the warning and the stop.")
        # Seconds by this machine's monotonic clock; whether the warning is due by the service's
        # (stop_in_seconds): the two machines' wall clocks need not agree.
        began = time.monotonic()
        warned_at = stopped_at = None
        warn_before, every = idle.get("warn_before_seconds"), idle.get("check_every_seconds")
        deadline = began + timeout + 600
        while time.monotonic() < deadline:
            model = await self.t.server_model(self.user, self.server)
            now = time.monotonic()
            if model is None:  # (stopped, and no longer stopping)
                stopped_at = now
                break
            idle = (await self.t.status(self.user, self.server)).get("idle") or {}
            left = idle.get("stop_in_seconds")
            if warned_at is None and left is not None and warn_before is not None and left <= warn_before:
                warned_at = now  # what the Lab shows from then on, while the machine still runs
            await asyncio.sleep(2)
        figures = {"timeout seconds": timeout, "warned after s": _after(began, warned_at),
                   "stopped after s": _after(began, stopped_at)}
        if stopped_at is None:
            return FAIL, f"The idle workstation was not stopped within {timeout + 600} s.", figures
        if warned_at is None:
            return FAIL, "The idle workstation was stopped without a warning time having come first.", figures
        ahead = round(stopped_at - warned_at, 1)
        figures["warning before stop s"] = ahead
        slack = (every or 60) + 6  # (the culler's round, and two polls of 2 s)
        if warn_before and ahead < warn_before - slack:
            return FAIL, (f"The warning came {ahead:.0f} s before the stop; the Lab promises {warn_before} s "
                          "(c.Workstations.idle_warn_before)."), figures
        after = await self.t.status(self.user, self.server)
        if not (after.get("disks") or {}).get("root"):
            return FAIL, "The root disk is gone after the idle stop.", figures
        # the rest of the suite wants it running again
        await self.t.start(self.user, self.server, self.o.profile, self.o.start_timeout)
        return PASS, "The idle workstation was warned first, then stopped; its disks stay.", figures


def _after(began: float, when: float | None) -> float | None:
    return None if when is None else round(when - began, 1)
