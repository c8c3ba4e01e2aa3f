"""The audit trail: one INFO line per action ("audit: WHO ACTION WORKSTATION: RESULT (DETAIL)"),
and the one path every action on a workstation takes (`audited`): its line, its count in
the metrics, and a refusal turned into the sentence the caller gets."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from .. import kube as k
from ..workstation import Workstation, WorkstationError
from .access import Caller, ServiceError, cluster_refusal, workstation_path
from .hub import HubError

if TYPE_CHECKING:
    from .metrics import ServiceMetrics

T = TypeVar("T")


class Audit:
    def __init__(self, log: logging.Logger | logging.LoggerAdapter, metrics: ServiceMetrics):
        self.log = log
        self.metrics = metrics

    def line(self, who: str, action: str, path: str, result: str, detail: str = "") -> None:
        self.log.info("audit: %s %s %s: %s%s", who, action, path, result, f" ({detail})" if detail else "")

    def of(self, caller: Caller, action: str, ws: Workstation, result: str, detail: str = "") -> None:
        """The line of the caller's action on the workstation."""
        self.line(caller.name, action, workstation_path(ws.ident.user, ws.ident.server), result, detail)

    async def audited(self, caller: Caller, action: str, ws: Workstation, work: Awaitable[T], detail: str = "",
                      done: Callable[[T], str] = lambda _: "done") -> T:
        """Do the work, then write its line (`done` says what it did) and count it; a failure is
        written, counted (refused: what the caller asked could not be; failed: for the alerts) and
        raised as a ServiceError."""
        try:
            result = await work
        except WorkstationError as err:
            self.of(caller, action, ws, f"failed: {err.jupyterhub_message}", detail)
            self.metrics.operations.labels(action, "refused" if err.status_code < 500 else "failed").inc()
            raise ServiceError(err.status_code, err.jupyterhub_message or str(err)) from None
        except k.KubeError as err:
            self.of(caller, action, ws, f"failed: the cluster refused: {err}", detail)
            self.metrics.operations.labels(action, "failed").inc()
            raise cluster_refusal(err) from None
        except HubError as err:
            self.of(caller, action, ws, f"failed: the hub said {err}", detail)
            self.metrics.operations.labels(action, "failed").inc()
            raise ServiceError(502, f"The hub refused: {err.message}") from None
        self.of(caller, action, ws, done(result), detail)
        self.metrics.operations.labels(action, "succeeded").inc()
        return result
