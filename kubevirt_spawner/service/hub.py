"""The service's calls to JupyterHub's REST API, with its own token (JUPYTERHUB_API_TOKEN): read
users and servers, stop and start servers (so the hub's view stays true), record activity."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime, timezone
from urllib.parse import quote

import aiohttp

from ..reasons import Reason
from ..workstation import WorkstationError


class HubError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def server_path(user: str, server: str) -> str:
    """/users/NAME/server for the default server, /users/NAME/servers/SERVER for a named one."""
    base = f"/users/{quote(user, safe='')}"
    return f"{base}/servers/{quote(server, safe='')}" if server else f"{base}/server"


class Hub:
    def __init__(self, api_url: str, token: str, log: logging.Logger | logging.LoggerAdapter,
                 timeout: float = 30.0):
        self.api_url = api_url.rstrip("/")
        self.token = token
        self.log = log
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers={"Authorization": f"token {self.token}"}, trust_env=False)
        return self._session

    async def close(self):
        if self._session is not None:
            await self._session.close()

    async def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict | None]:
        async with self._http().request(method, self.api_url + path, json=body,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
            data = await resp.json(content_type=None) if resp.content_length != 0 else None
            if resp.status >= 400:
                message = (data or {}).get("message") if isinstance(data, dict) else None
                raise HubError(resp.status, message or resp.reason or "")
            return resp.status, data

    async def user(self, name: str) -> dict | None:
        try:
            return (await self.call("GET", f"/users/{quote(name, safe='')}"))[1]
        except HubError as err:
            if err.status == 404:
                return None
            raise

    async def server(self, user: str, server: str) -> dict | None:
        """The hub's model of the server (ready, pending, ...), None when it has none."""
        model = await self.user(user)
        return ((model or {}).get("servers") or {}).get(server)

    async def last_start(self, user: str, server: str) -> dict | None:
        """The hub's last word on the server's start (its progress stream: the failure, or ready),
        None when the hub has nothing to say."""
        async with self._http().get(self.api_url + server_path(user, server) + "/progress",
                                    timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
        events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
        return events[-1] if events else None

    async def running(self, user: str, server: str) -> bool:
        model = await self.server(user, server)
        return bool(model and (model.get("ready") or model.get("pending") == "spawn"))

    async def stop(self, user: str, server: str, timeout: float):
        """Stop through the hub and wait until the hub says it is stopped."""
        try:
            await self.call("DELETE", server_path(user, server))
        except HubError as err:
            if err.status not in (204, 400, 404):  # 400: not running
                raise
        await self._wait(user, server, lambda model: model is None or (not model.get("ready")
                                                                        and not model.get("pending")), timeout,
                         "stop")

    async def start(self, user: str, server: str):
        """Ask the hub to start the server; the hub follows the start itself."""
        try:
            await self.call("POST", server_path(user, server), {})
        except HubError as err:
            if err.status == 400 and "already" in err.message:
                return
            raise

    async def _wait(self, user: str, server: str, done, timeout: float, what: str):
        deadline = asyncio.get_running_loop().time() + timeout
        while not done(await self.server(user, server)):
            if asyncio.get_running_loop().time() > deadline:
                raise WorkstationError(f"The hub did not {what} the workstation within {timeout:.0f} seconds; try "
                                       "again later or ask your administrator.", reason=Reason.TIMEOUT, status_code=504)
            await asyncio.sleep(1.0)

    async def record_activity(self, user: str, server: str, until: datetime):
        """Tell the hub the server is in use (POST /users/NAME/activity), as the server itself would."""
        stamp = until.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        await self.call("POST", f"/users/{quote(user, safe='')}/activity",
                        {"servers": {server: {"last_activity": stamp}}})


class HubServer:
    """One server as the hub knows it (operations.Server)."""

    def __init__(self, hub: Hub, user: str, server: str, stop_timeout: float):
        self.hub, self.user, self.server, self.stop_timeout = hub, user, server, stop_timeout

    async def running(self) -> bool:
        return await self.hub.running(self.user, self.server)

    async def stop(self):
        await self.hub.stop(self.user, self.server, self.stop_timeout)

    async def start(self):
        await self.hub.start(self.user, self.server)
