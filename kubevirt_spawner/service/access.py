"""Who may act on what: the caller of a request, the checks of its rights, and the refusals the
service answers with (an HTTP status and one sentence)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import kube as k
from . import SERVICE_NAME

if TYPE_CHECKING:
    from ..workstation import Workstation
    from .hubsettings import HubSettings
    from .settings import WorkstationsSettings

# What `server_token_actions` may allow a workstation's own token, in words for the refusal.
SERVER_TOKEN_ACTIONS = {"restore": "restore a snapshot", "reset": "reset the system",
                        "delete-snapshot": "delete a snapshot"}


class ServiceError(Exception):
    """Bad input or a refused action: an HTTP status and one sentence; nothing was changed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Caller:
    name: str
    admin: bool
    # A server's own token: the workstations ("user/server") it may act on; None: all of the user's.
    servers: frozenset[str] | None = None
    # JupyterHub's read:metrics scope (a monitoring service's token reads the metrics, nothing more)
    reads_metrics: bool = False

    def may_act_on(self, user: str, server: str) -> bool:
        if self.admin:
            return True
        return self.name == user and (self.servers is None or f"{user}/{server}" in self.servers)


# What the service does on its own (a drain's stop), in audit lines
SERVICE_CALLER = Caller(f"service:{SERVICE_NAME}", admin=True)


def workstation_path(user: str, server: str) -> str:
    return f"{user}/{server}" if server else user


def cluster_refusal(err: k.KubeError) -> ServiceError:
    """A request of the cluster's that no step turned into a sentence: its cause in words (the
    details are for the log)."""
    unavailable = err.status >= 500 or err.status in (0, 429)
    return ServiceError(503 if unavailable else err.status, f"The cluster did not take the request ({err.for_users}). "
                                                            "Try again in a minute; if it keeps failing, tell your "
                                                            "administrator.")


class Access:
    """The checks a request passes before anything is done: the caller's rights on the
    workstation, what a workstation's own token may do, and that the workstation exists."""

    def __init__(self, settings: WorkstationsSettings, hub_settings: HubSettings):
        self.settings = settings
        self.hub_settings = hub_settings

    @staticmethod
    def authorize(caller: Caller, user: str, server: str | None = None) -> None:
        """The caller's own workstations (a server's token: that server's), or any for an admin."""
        if caller.name != user and not caller.admin:
            raise ServiceError(403, "You may only act on your own workstations.")
        if server is not None and not caller.may_act_on(user, server):
            raise ServiceError(403, "This is a server's token: it acts on that server's workstation only.")

    async def existing(self, caller: Caller, user: str, server: str) -> Workstation:
        """The workstation the caller names, if they may act on it and it exists."""
        self.authorize(caller, user, server)
        ws = await self.hub_settings.workstation(user, server)
        if ws.vm is None:
            which = f"named {server}" if server else ""
            raise ServiceError(404, f"{user} has no workstation {which}".rstrip() + ".")
        return ws

    def refuse_server_token(self, caller: Caller, action: str) -> None:
        """The owner's own login, or a token of theirs that is not a workstation's, for what
        `server_token_actions` keeps from a workstation's token."""
        allowed = set(self.settings.server_token_actions)
        if not self.settings.safety_snapshot:
            allowed -= {"restore", "reset"}  # (no safety snapshot: nothing would undo them)
        if caller.servers is not None and action not in allowed:
            raise ServiceError(403, f"A workstation's own token may not {SERVER_TOKEN_ACTIONS[action]} (anyone with "
                                    "a terminal in the workstation can read it); do it on the workstations page, "
                                    "logged in as yourself.")

    @staticmethod
    def refuse_key_change(caller: Caller, user: str, action: str) -> None:
        """SSH keys open all the user's workstations: only the user's own login adds or deletes
        them (an admin may delete one)."""
        if caller.name != user and not (caller.admin and action == "delete"):
            raise ServiceError(403, "You may only add or delete your own SSH keys (an admin may delete one).")
        if caller.name == user and caller.servers is not None:
            raise ServiceError(403, f"A workstation's own token may not {action} SSH keys (anyone with a terminal "
                                    "in the workstation can read it, and the keys open all your workstations); "
                                    "do it on the workstations page, logged in as yourself.")
