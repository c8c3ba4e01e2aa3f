"""What the acceptance suite reaches, through public interfaces only: JupyterHub's REST API, a
workstation's Jupyter API through the hub (kernels), the workstations service's API, and, with a
kubeconfig, read access to the cluster."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any
from urllib.parse import quote

import aiohttp

from ..ssh import ClientError, Hub, Login, server_url

SERVICE_API = "services/workstations/api/v1/"
KERNEL_TIMEOUT = 300.0


class AcceptanceError(Exception):
    """An experiment could not do what it needed: its FAIL, in one sentence."""


class NamedServersOff(AcceptanceError):
    """The hub has no named servers (c.JupyterHub.allow_named_servers)."""


class GuestError(AcceptanceError):
    """Code run in the workstation raised: its last line (the exception)."""


def workstation_name(user: str, server: str) -> str:
    return f"{user}/{server}" if server else user


class Target:
    """One hub, as one token (an admin's) sees it."""

    def __init__(self, session: aiohttp.ClientSession, url: str, token: str):
        self.session = session
        self.login = Login(url, token)
        self.hub = Hub(self.login, session)

    @property
    def url(self) -> str:
        return self.login.url

    # ------------------------------------------------------------ JupyterHub's REST API
    async def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return await self.hub.call(method, path, body)

    async def as_user(self, token: str, method: str, url: str, body: Any = None) -> tuple[int, Any]:
        """A request with another token (a user's), to any URL under the hub."""
        return await Hub(Login(self.url, token), self.session).request(method, url, body)

    async def ensure_user(self, name: str) -> bool:
        """The hub user `name`, made when missing: True when this call made it."""
        status, data = await self.api("POST", f"users/{quote(name, safe='')}")
        if status == 201:
            return True
        if status == 409:
            return False
        raise AcceptanceError(f"The hub did not make the test user {name} ({status}): {_message(data)}")

    async def token_for(self, user: str, note: str, expires_in: int = 3600) -> tuple[str, str]:
        """A new API token of `user`: (the token, its id, with which `revoke_token` removes it)."""
        status, data = await self.api("POST", f"users/{quote(user, safe='')}/tokens",
                                      {"note": note, "expires_in": expires_in})
        if status != 201 or not isinstance(data, dict) or not data.get("token"):
            raise AcceptanceError(f"The hub did not give {user} a token ({status}): {_message(data)}")
        return data["token"], str(data.get("id") or "")

    async def revoke_token(self, user: str, token_id: str) -> None:
        status, data = await self.api("DELETE", f"users/{quote(user, safe='')}/tokens/{quote(token_id, safe='')}")
        if status not in (204, 404):  # (404: gone already, with its user)
            raise AcceptanceError(f"The hub did not revoke {user}'s token {token_id} ({status}): {_message(data)}")

    async def server_model(self, user: str, server: str) -> dict | None:
        status, data = await self.api("GET", f"users/{quote(user, safe='')}?include_stopped_servers=1")
        if status != 200 or not isinstance(data, dict):
            raise AcceptanceError(f"The hub did not describe {user} ({status}): {_message(data)}")
        model = (data.get("servers") or {}).get(server)
        return model if isinstance(model, dict) and (model.get("ready") or model.get("pending")) else None

    async def start(self, user: str, server: str, profile: str | None, timeout: float) -> float:
        """Start the workstation and wait until the hub says it is ready: the seconds it took."""
        began = time.monotonic()
        while ((await self.server_model(user, server)) or {}).get("pending") == "stop":  # (a stop still under way)
            if time.monotonic() - began > timeout:
                raise AcceptanceError(f"{workstation_name(user, server)} was still stopping after {timeout:.0f} s.")
            await asyncio.sleep(1)
        options = {"profile": profile} if profile else {}
        status, data = await self.api("POST", self.hub.server_path(user, server), options)
        if status == 400 and server and "named server" in _message(data).lower():
            raise NamedServersOff(_message(data))
        if status not in (201, 202):
            raise AcceptanceError(f"The hub did not start {workstation_name(user, server)} ({status}): "
                                  f"{_message(data)}")
        try:
            async for event in self.hub.progress(user, server):
                if event.get("failed"):
                    raise AcceptanceError(f"{workstation_name(user, server)} did not start: "
                                          f"{event.get('message') or 'the hub gave no reason'}")
                if event.get("ready"):
                    break
        except ClientError:
            pass  # (the progress stream has its own bound: the hub's view is polled on below)
        while True:
            model = await self.server_model(user, server)
            if model and model.get("ready"):
                return time.monotonic() - began
            if model is None:  # (neither ready nor pending: the start ended without a server)
                raise AcceptanceError(f"{workstation_name(user, server)} did not start; see the hub's page for why.")
            if time.monotonic() - began > timeout:
                raise AcceptanceError(f"{workstation_name(user, server)} was not ready within {timeout:.0f} s.")
            await asyncio.sleep(1)

    async def stop(self, user: str, server: str, timeout: float) -> float:
        """Stop the workstation through the hub and wait until the hub has it stopped: seconds."""
        began = time.monotonic()
        status, data = await self.api("DELETE", self.hub.server_path(user, server))
        if status not in (202, 204, 404):
            raise AcceptanceError(f"The hub did not stop {workstation_name(user, server)} ({status}): "
                                  f"{_message(data)}")
        while await self.server_model(user, server) is not None:
            if time.monotonic() - began > timeout:
                raise AcceptanceError(f"{workstation_name(user, server)} was not stopped within {timeout:.0f} s.")
            await asyncio.sleep(1)
        return time.monotonic() - began

    async def delete_server(self, user: str, server: str) -> None:
        """Delete a named server from the hub (its disks stay: the spawner keeps them)."""
        status, data = await self.api("DELETE", self.hub.server_path(user, server), {"remove": True})
        if status not in (202, 204, 404):
            raise AcceptanceError(f"The hub did not delete {workstation_name(user, server)} ({status}): "
                                  f"{_message(data)}")

    async def url_of(self, user: str, server: str) -> str:
        model = await self.server_model(user, server)
        if not model or not model.get("ready"):
            raise AcceptanceError(f"{workstation_name(user, server)} is not running.")
        return server_url(self.login, model)

    # ------------------------------------------------------------ the workstations service
    def service_url(self, path: str) -> str:
        return self.url + SERVICE_API + path

    def workstation_path(self, user: str, server: str) -> str:
        who = quote(user, safe="")
        return f"workstations/{who}/servers/{quote(server, safe='')}" if server else f"workstations/{who}"

    async def service(self, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
        if token is not None:
            return await self.as_user(token, method, self.service_url(path), body)
        return await self.hub.request(method, self.service_url(path), body)

    async def status(self, user: str, server: str, token: str | None = None) -> dict:
        status, data = await self.service("GET", self.workstation_path(user, server), token=token)
        if status != 200 or not isinstance(data, dict):
            raise AcceptanceError(f"The workstations service did not describe {workstation_name(user, server)} "
                                  f"({status}): {_message(data)}")
        return data

    async def wait_operation(self, user: str, server: str, begun: dict, timeout: float) -> dict:
        """Wait until the operation the service began (`begun`: its 202 answer, a restore or a
        reset) has ended: its record. An earlier operation's record, still on the VM, is not it."""
        kind = begun.get("kind")

        def same(op: dict) -> bool:
            if begun.get("id"):
                return op.get("id") == begun["id"]
            return op.get("kind") == kind and op.get("started") == begun.get("started")
        deadline = time.monotonic() + timeout
        while True:
            op = (await self.status(user, server)).get("operation") or {}
            if same(op) and op.get("state") != "running":
                return op
            if time.monotonic() > deadline:
                raise AcceptanceError(f"The {kind} of {workstation_name(user, server)} did not end within "
                                      f"{timeout:.0f} s (it is {op.get('description') or 'not recorded'}).")
            await asyncio.sleep(1)

    # ------------------------------------------------------------ the workstation's Jupyter
    async def run_python(self, user: str, server: str, code: str, timeout: float = KERNEL_TIMEOUT,
                         token: str | None = None) -> str:
        """Run `code` in a new kernel of the workstation's Jupyter (through the hub), and return
        what it printed; the kernel is shut down after. An exception in the guest is a GuestError."""
        base = await self.url_of(user, server)
        headers = {"Authorization": f"token {token or self.login.token}"}
        async with self.session.post(base + "api/kernels", json={"name": "python3"}, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=120)) as r:
            if r.status != 201:
                raise AcceptanceError(f"The workstation's Jupyter did not start a kernel ({r.status}).")
            kernel = (await r.json())["id"]
        try:
            return await asyncio.wait_for(self._execute(base, kernel, headers, code), timeout)
        except asyncio.TimeoutError:
            raise AcceptanceError(f"Code in the workstation did not finish within {timeout:.0f} s.") from None
        finally:
            async with self.session.delete(base + f"api/kernels/{kernel}", headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=60)):
                pass

    async def _execute(self, base: str, kernel: str, headers: dict, code: str) -> str:
        ws_url = base.replace("http", "ws", 1) + f"api/kernels/{kernel}/channels"
        msg_id = uuid.uuid4().hex
        out: list[str] = []
        async with self.session.ws_connect(ws_url, headers=headers, max_msg_size=0) as ws:
            await ws.send_str(json.dumps({
                "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "acceptance",
                           "session": msg_id, "version": "5.3", "date": ""},
                "parent_header": {}, "metadata": {}, "channel": "shell",
                "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                            "allow_stdin": False, "stop_on_error": True}}))
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    break
                reply = json.loads(message.data)
                if (reply.get("parent_header") or {}).get("msg_id") != msg_id:
                    continue
                kind, content = reply.get("msg_type"), reply.get("content") or {}
                if kind == "stream":
                    out.append(content.get("text", ""))
                elif kind == "error":
                    raise GuestError(f"{content.get('ename')}: {content.get('evalue')}"[:500])
                elif kind == "status" and content.get("execution_state") == "idle":
                    return "".join(out)
        raise AcceptanceError("The workstation's kernel closed its connection before the code finished.")

    async def guest_json(self, user: str, server: str, code: str, timeout: float = KERNEL_TIMEOUT) -> Any:
        """Run `code`, whose last printed line is JSON, and return that."""
        printed = await self.run_python(user, server, code, timeout)
        lines = printed.strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, ValueError):
            raise AcceptanceError(f"The workstation printed no answer: {printed[-300:]!r}") from None


def _message(data: Any) -> str:
    if isinstance(data, dict):
        for key in ("message", "error"):
            if isinstance(data.get(key), str):
                return data[key][:300]
    return "no reason given."
