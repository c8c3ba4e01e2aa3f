"""`kubevirt-spawner admin ...`: what a hub admin does from a terminal, through the workstations
service's API with their JupyterHub token (the same login as the SSH commands; the token needs
admin:servers).

`admin drain NODE` warns every workstation on the node and has the service stop each after its
grace (service/drains.py), waits until none runs there, then prints the `kubectl drain` to run.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, TextIO
from urllib.parse import quote

import aiohttp

from . import names
from .ssh import ClientError, Hub, Login

SERVICE_API = "services/workstations/api/v1/"
POLL_SECONDS = 5.0


def kubectl_drain(node: str) -> str:
    # virt-launcher pods hold emptyDirs of their own; DaemonSets (virt-handler) stay
    return f"kubectl drain {node} --ignore-daemonsets --delete-emptydir-data"


def _who(entry: dict) -> str:
    user = names.printable(str(entry.get("user", "?")))
    return f"{user}/{names.printable(str(entry['server']))}" if entry.get("server") else user


async def _service(hub: Hub, method: str, path: str, body: Any = None) -> dict:
    status, data = await hub.request(method, hub.login.url + SERVICE_API + path, body)
    if status == 200 and isinstance(data, dict):
        return data
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        raise ClientError(names.printable(data["error"]))
    if status in (401, 403):
        raise ClientError(f"The hub at {hub.login.url} refused the token ({status}): an admin's token with "
                          "admin:servers is needed.")
    raise ClientError(f"The workstations service at {hub.login.url}{SERVICE_API} answered {status}; is it "
                      "registered with this hub?")


async def drain(login: Login, node: str, dry_run: bool, reason: str | None, timeout: float | None, out: TextIO,
                poll: float = POLL_SECONDS) -> int:
    path = "drains/" + quote(node, safe="")
    async with aiohttp.ClientSession() as session:
        hub = Hub(login, session)
        result = await _service(hub, "POST", path, {"dry_run": dry_run, "reason": reason})
        listed = result.get("workstations") or []
        if dry_run:
            if not listed:
                print(f"No workstation runs on {node}: nobody would be warned.", file=out)
            for entry in listed:
                print(f"would warn {_who(entry)}, and stop it {result['grace_seconds']} s later", file=out)
            return 0
        for entry in listed:
            print(f"warned {_who(entry)}: stopped at {entry.get('deadline') or 'once the drain already under way ends'}",
                  file=out)
        if timeout is None:  # (the grace, and time for the machines to shut down)
            timeout = float(result.get("grace_seconds") or 0) + 300
        ends = time.monotonic() + timeout
        left = len(listed)
        while left:
            if time.monotonic() > ends:
                raise ClientError(f"{left} workstation(s) still run on {node} after {int(timeout)} s; see "
                                  f"kubevirt-spawner admin drain {node} --dry-run.")
            await asyncio.sleep(poll)
            now = len((await _service(hub, "GET", path)).get("workstations") or [])
            if now != left:
                print(f"{now} workstation(s) still on {node}", file=out)
            left = now
    print(f"No workstation runs on {node}. Drain it now:\n  {kubectl_drain(node)}", file=out)
    return 0
