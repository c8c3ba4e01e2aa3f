"""Users' SSH keys through the service: who may read, add and delete them (the keys are the
JupyterHub account's, found by its name and creation time), each change in an audit line."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import aiohttp

from .access import Access, Caller, ServiceError
from .hub import Hub, HubError
from .sshkeys import BadKey, KeyConflict, KeyStore, parse_public_key

if TYPE_CHECKING:
    from .audit import Audit


class UserKeys:
    def __init__(self, store: KeyStore, hub: Hub, access: Access, audit: Audit):
        self.store = store
        self.hub = hub
        self.access = access
        self.audit = audit

    async def _account_created(self, user: str) -> str:
        """The JupyterHub account's creation time: keys are that account's, not its name's."""
        try:
            model = await self.hub.user(user)
        except HubError as err:
            raise ServiceError(502, f"The hub refused to say who {user} is: {err.message}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise ServiceError(503, f"The hub does not answer ({type(err).__name__}); try again in a moment.") from None
        if model is None:
            raise ServiceError(404, f"JupyterHub has no user {user}.")
        return str(model.get("created") or "")

    async def keys(self, caller: Caller, user: str) -> dict:
        """The user's SSH public keys: for the user (a workstation's own token too: its sshd asks
        with it at every login) and admins."""
        self.access.authorize(caller, user)
        created = await self._account_created(user)
        return {"ssh_keys": await asyncio.to_thread(self.store.keys, user, created)}

    async def add(self, caller: Caller, user: str, text) -> dict:
        self.access.refuse_key_change(caller, user, "add")
        try:
            key = parse_public_key(text)
        except BadKey as err:
            raise ServiceError(400, str(err)) from None
        created = await self._account_created(user)
        try:
            added = await asyncio.to_thread(self.store.add, user, created, key)
        except KeyConflict as err:
            raise ServiceError(409, str(err)) from None
        self.audit.line(caller.name, "add-ssh-key", user, f"{key.type} {key.fingerprint}")
        return added

    async def delete(self, caller: Caller, user: str, fingerprint: str) -> dict:
        self.access.refuse_key_change(caller, user, "delete")
        created = await self._account_created(user)
        if not await asyncio.to_thread(self.store.delete, user, created, fingerprint):
            raise ServiceError(404, f"{user} has no SSH key with the fingerprint {fingerprint[:80]}.")
        self.audit.line(caller.name, "delete-ssh-key", user, fingerprint)
        return {"deleted": fingerprint}
