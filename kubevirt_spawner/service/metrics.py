"""The service's Prometheus metrics: operations and their durations, snapshots per user, full
disks, drains (the meter adds what workstations hold and cost, metering.Meter)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .. import manifests as m

if TYPE_CHECKING:
    from ..reflector import Caches
    from .usage import DiskUsage


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.operations = Counter("workstations_operations", "Operations by kind (snapshot, restore, reset) and result "
                                  "(succeeded, failed, refused)",
                                  ["kind", "result"], registry=self.registry)
        # The series the alerts watch exist from the start, at 0: Prometheus' increase() cannot see
        # a series' first sample as an increase, so a first failure would otherwise go unnoticed.
        for kind in ("snapshot", "restore", "reset"):
            for result in ("succeeded", "failed", "refused"):
                self.operations.labels(kind, result)
        self.durations = Histogram("workstations_operation_seconds", "How long operations took", ["kind"],
                                   buckets=(1, 5, 15, 60, 300, 900, 1800, 3600), registry=self.registry)
        self.snapshots = Gauge("workstations_snapshots", "Snapshots per user", ["user"], registry=self.registry)
        self.full = Gauge("workstations_disks_above_85_percent", "Disks over 85 % full (last known)",
                          registry=self.registry)
        self.drains = Counter("workstations_drains", "Workstations warned of a node drain (warned), stopped by one "
                              "after the grace (stopped-after-grace), during it (stopped-before-grace) or with no "
                              "warning, their pods deleted (stopped-without-warning), and warnings withdrawn by an "
                              "uncordon (withdrawn)", ["event"], registry=self.registry)
        for event in ("warned", "stopped-after-grace", "stopped-before-grace", "stopped-without-warning", "withdrawn"):
            self.drains.labels(event)

    def refresh(self, caches: Caches, usage: DiskUsage) -> None:
        """The gauges read at a scrape: each user's snapshots (the caches'), the disks over 85 %."""
        per_user: dict[str, int] = {}
        for snap in caches.snapshots.values():
            user = (snap["metadata"].get("annotations") or {}).get(m.ANNOTATION_USERNAME)
            if user:
                per_user[user] = per_user.get(user, 0) + 1
        self.snapshots.clear()
        for user, count in per_user.items():
            self.snapshots.labels(user).set(count)
        self.full.set(usage.full_disks(85))
