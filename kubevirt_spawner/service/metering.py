"""What each workstation held, for how long, and what it cost.

The workstations service records lifetimes: of each machine (a VMI: its CPUs, memory and GPUs
while it runs), each disk (a claim: its size) and each snapshot (the size of the disks it
restores, as the VolumeSnapshots' restoreSize counts it). They live in the hub's database (table
`kubevirt_spawner_lifetimes`, beside the users' SSH keys: `c.Workstations.ssh_keys_db_url`), so
they outlive a restart of the service. A lifetime starts when its object was made (its
creationTimestamp) and ends at the last time the service saw the object: an end while the service
was down is counted up to its last look, never beyond.

Costs are configured capacity, priced by `c.Workstations.prices`: CPU-hours, GiB-hours of memory
and GPU-hours by model while a machine runs; GiB-months of disk and of snapshot always (a
GiB-month is 730 GiB-hours). Without prices the figures stay in those units.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import sqlalchemy as sa
from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily

from .. import manifests as m
from ..objects import field_value
from ..quantity import parse_quantity

HOURS_PER_MONTH = 730.0
GIB = 2.0 ** 30
KINDS = ("machine", "disk", "snapshot")
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
ONE_HOUR = timedelta(hours=1)
PRICE_KEYS = {"currency", "cpu_hour", "memory_gib_hour", "gpu_hour", "disk_gib_month", "snapshot_gib_month"}

METADATA = sa.MetaData()
LIFETIMES = sa.Table(
    "kubevirt_spawner_lifetimes", METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("uid", sa.String(64), nullable=False, index=True),  # the object's uid
    sa.Column("kind", sa.String(16), nullable=False),  # machine, disk or snapshot
    sa.Column("user", sa.String(255), nullable=False, index=True),
    sa.Column("server", sa.String(255), nullable=False),
    sa.Column("profile", sa.String(255), nullable=False),
    sa.Column("name", sa.String(255), nullable=False),
    sa.Column("held", sa.Text, nullable=False),  # JSON: {"cpu", "memory_gib", "gpus": {model: n}} or {"gib"}
    sa.Column("started", sa.DateTime, nullable=False),  # (UTC, naive: as every database keeps it)
    sa.Column("last_seen", sa.DateTime, nullable=False),
    sa.Column("ended", sa.DateTime, nullable=True),
)
# When the ledger began: nothing is charged for before it (objects older than the metering).
LEDGER = sa.Table("kubevirt_spawner_ledger", METADATA,
                  sa.Column("id", sa.Integer, primary_key=True), sa.Column("began", sa.DateTime, nullable=False))
CHUNK = 500  # ids or uids per statement (a database's limit on bound parameters)


def _chunks(items: list) -> list[list]:
    return [items[i:i + CHUNK] for i in range(0, len(items), CHUNK)]


@dataclass(frozen=True)
class Held:
    """One object a workstation holds now, as the service sees it."""
    uid: str
    kind: str
    user: str
    server: str
    profile: str
    name: str
    held: dict
    started: datetime


@dataclass(frozen=True)
class Lifetime:
    kind: str
    user: str
    server: str
    profile: str
    name: str
    held: dict
    started: datetime
    ended: datetime | None  # None: still there


@dataclass
class Usage:
    """Resource units used in a period."""
    cpu_hours: float = 0.0
    memory_gib_hours: float = 0.0
    gpu_hours: dict[str, float] = field(default_factory=dict)
    disk_gib_months: float = 0.0
    snapshot_gib_months: float = 0.0

    def add(self, other: Usage):
        self.cpu_hours += other.cpu_hours
        self.memory_gib_hours += other.memory_gib_hours
        for model, hours in other.gpu_hours.items():
            self.gpu_hours[model] = self.gpu_hours.get(model, 0.0) + hours
        self.disk_gib_months += other.disk_gib_months
        self.snapshot_gib_months += other.snapshot_gib_months

    def view(self) -> dict:
        return {"cpu_hours": round(self.cpu_hours, 4), "memory_gib_hours": round(self.memory_gib_hours, 4),
                "gpu_hours": {k: round(v, 4) for k, v in sorted(self.gpu_hours.items())},
                "disk_gib_months": round(self.disk_gib_months, 4),
                "snapshot_gib_months": round(self.snapshot_gib_months, 4)}


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def month_bounds(month: str) -> tuple[datetime, datetime]:
    """[first instant, first instant of the next month) of "YYYY-MM", in UTC."""
    try:
        start = datetime.strptime(month, "%Y-%m").replace(tzinfo=timezone.utc)
    except (TypeError, ValueError):
        raise ValueError(f'A month is written YYYY-MM (like "2026-12"), not {month!r}.') from None
    end = (start + timedelta(days=32)).replace(day=1)
    return start, end


def month_of(moment: datetime) -> str:
    return _utc(moment).strftime("%Y-%m")


def previous_month(month: str) -> str:
    start, _ = month_bounds(month)
    return month_of(start - timedelta(days=1))


def usage(lifetime: Lifetime, start: datetime, end: datetime, now: datetime) -> Usage:
    """What one lifetime used within [start, end) (an open one lasts until `now`)."""
    until = min(_utc(lifetime.ended) if lifetime.ended else _utc(now), _utc(end))
    hours = max(0.0, (until - max(_utc(lifetime.started), _utc(start))).total_seconds() / 3600.0)
    out = Usage()
    if not hours:
        return out
    held = lifetime.held
    if lifetime.kind == "machine":
        out.cpu_hours = float(held.get("cpu") or 0) * hours
        out.memory_gib_hours = float(held.get("memory_gib") or 0) * hours
        out.gpu_hours = {model: n * hours for model, n in (held.get("gpus") or {}).items()}
    elif lifetime.kind == "disk":
        out.disk_gib_months = float(held.get("gib") or 0) * hours / HOURS_PER_MONTH
    elif lifetime.kind == "snapshot":
        out.snapshot_gib_months = float(held.get("gib") or 0) * hours / HOURS_PER_MONTH
    return out


def rate(held: list[Held]) -> Usage:
    """Units per hour of what is held now."""
    out = Usage()
    for item in held:
        hour = Lifetime(item.kind, item.user, item.server, item.profile, item.name, item.held, EPOCH, EPOCH + ONE_HOUR)
        out.add(usage(hour, EPOCH, EPOCH + ONE_HOUR, EPOCH + ONE_HOUR))
    return out


def check_prices(prices: dict) -> dict:
    """The prices setting, checked: numbers not below 0, GPU prices by model."""
    unknown = sorted(set(prices) - PRICE_KEYS)
    if unknown:
        raise ValueError(f"c.Workstations.prices: {', '.join(unknown)} is not one of {', '.join(sorted(PRICE_KEYS))}")
    for key, value in prices.items():
        if key == "currency":
            if not isinstance(value, str) or not 0 < len(value) <= 8:
                raise ValueError('c.Workstations.prices: "currency" is a short name, like "EUR"')
        elif key == "gpu_hour":
            if not isinstance(value, dict) or not all(isinstance(k, str) and _price(v) for k, v in value.items()):
                raise ValueError('c.Workstations.prices: "gpu_hour" maps GPU resource names to prices per hour')
        elif not _price(value):
            raise ValueError(f"c.Workstations.prices: {key} must be a number, 0 or more")
    return prices


def _price(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def cost(used: Usage, prices: dict) -> dict | None:
    """The price of the units, by part and in all, in the prices' currency; None without prices."""
    if not prices:
        return None
    gpu_prices = prices.get("gpu_hour") or {}
    parts = {"cpu": used.cpu_hours * prices.get("cpu_hour", 0),
             "memory": used.memory_gib_hours * prices.get("memory_gib_hour", 0),
             "gpu": sum(hours * gpu_prices.get(model, 0) for model, hours in used.gpu_hours.items()),
             "disk": used.disk_gib_months * prices.get("disk_gib_month", 0),
             "snapshot": used.snapshot_gib_months * prices.get("snapshot_gib_month", 0)}
    return {"currency": prices.get("currency", ""), "total": round(sum(parts.values()), 4),
            **{k: round(v, 4) for k, v in parts.items()}}


# ------------------------------------------------------------------ what the cluster holds now
def held_now(caches) -> list[Held]:
    """Every machine, disk and snapshot of a workstation in the caches."""
    out: list[Held] = []
    by_name = {(vm["metadata"]["namespace"], vm["metadata"]["name"]): vm for vm in caches.vms.values()}
    by_label = {(vm["metadata"]["namespace"], (vm["metadata"].get("labels") or {}).get(m.LABEL_WORKSTATION)): vm
                for vm in caches.vms.values()}

    def owner(obj: dict, vm: dict | None) -> tuple[str, str, str] | None:
        """(user, server, profile): the user's names from the object, the profile from its VM."""
        ann = obj["metadata"].get("annotations") or {}
        if not ann.get(m.ANNOTATION_USERNAME):
            return None
        profile = ((vm or {}).get("metadata", {}).get("annotations") or {}).get(m.ANNOTATION_PROFILE, "")
        return ann[m.ANNOTATION_USERNAME], ann.get(m.ANNOTATION_SERVERNAME, ""), profile

    for vmi in caches.vmis.values():
        # (a machine counts while it runs: not while it waits to be scheduled or shuts down)
        if field_value(vmi, "status.phase") != "Running" or vmi["metadata"].get("deletionTimestamp"):
            continue
        vm = by_name.get((vmi["metadata"]["namespace"], vmi["metadata"]["name"]))
        who = owner(vm, vm) if vm else None
        if who is None:
            continue
        requests = field_value(vmi, "spec.domain.resources.requests") or {}
        gpus: dict[str, int] = {}
        for gpu in field_value(vmi, "spec.domain.devices.gpus") or []:
            gpus[gpu.get("deviceName", "?")] = gpus.get(gpu.get("deviceName", "?"), 0) + 1
        running = next((t.get("phaseTransitionTimestamp") for t in field_value(vmi, "status.phaseTransitionTimestamps")
                        or [] if t.get("phase") == "Running"), None)
        out.append(_held(vmi, "machine", who, {"cpu": float(parse_quantity(requests.get("cpu") or "0")),
                                               "memory_gib": float(parse_quantity(requests.get("memory") or "0")) / GIB,
                                               "gpus": gpus}, since=running))

    def vm_of(obj: dict) -> dict | None:
        return by_label.get((obj["metadata"]["namespace"], (obj["metadata"].get("labels") or {}).get(m.LABEL_WORKSTATION)))

    claims: dict[tuple[str, str], float] = {}
    for pvc in caches.pvcs.values():
        size = float(parse_quantity(field_value(pvc, "status.capacity.storage")
                                    or field_value(pvc, "spec.resources.requests.storage") or "0")) / GIB
        claims[(pvc["metadata"]["namespace"], pvc["metadata"]["name"])] = size
        who = owner(pvc, vm_of(pvc))
        if who is not None:
            out.append(_held(pvc, "disk", who, {"gib": size}))
    for snap in caches.snapshots.values():
        vm = vm_of(snap)
        who = owner(snap, vm)
        if who is None:
            continue
        # (each VolumeSnapshot's restoreSize is the size of the disk it restores)
        volumes = {v.get("name"): (v.get("persistentVolumeClaim") or {}).get("claimName")
                   or (v.get("dataVolume") or {}).get("name")
                   for v in field_value(vm, "spec.template.spec.volumes") or []}
        included = field_value(snap, "status.snapshotVolumes.includedVolumes") or []
        gib = sum(claims.get((snap["metadata"]["namespace"], volumes.get(v) or ""), 0.0) for v in included)
        out.append(_held(snap, "snapshot", who, {"gib": gib}))
    return out


def _held(obj: dict, kind: str, who: tuple[str, str, str], held: dict, since: str | None = None) -> Held:
    created = since or obj["metadata"].get("creationTimestamp") or ""
    try:
        started = _utc(datetime.fromisoformat(created.replace("Z", "+00:00")))
    except ValueError:
        started = datetime.now(timezone.utc)
    user, server, profile = who
    return Held(obj["metadata"]["uid"], kind, user, server, profile, obj["metadata"]["name"], held, started)


# ------------------------------------------------------------------ the ledger
def _naive(moment: datetime) -> datetime:
    return _utc(moment).replace(tzinfo=None)


class Ledger:
    """The lifetimes table. Its calls block (the database driver): the service runs them in a thread."""

    def __init__(self, url: str):
        self.url = url
        self._engine: sa.Engine | None = None
        self._making = threading.Lock()

    @property
    def engine(self) -> sa.Engine:
        with self._making:
            if self._engine is None:
                engine = sa.create_engine(self.url, future=True)
                METADATA.create_all(engine)
                self._engine = engine
        return self._engine

    def observe(self, held: list[Held], now: datetime):
        """What is held now. A new object's lifetime begins (at its creation, not before the
        ledger's start); one still there was seen now; one whose size changed (a disk grown) ends
        now and a new one begins, so the past keeps its price; one gone ends at its last sighting."""
        present = {h.uid: h for h in held}
        seen = _naive(now)
        with self.engine.begin() as db:
            began = db.execute(sa.select(LEDGER.c.began)).scalar()
            if began is None:
                db.execute(sa.insert(LEDGER).values(id=1, began=seen))
                began = seen
            open_rows = {row.uid: row for row in db.execute(
                sa.select(LIFETIMES.c.id, LIFETIMES.c.uid, LIFETIMES.c.kind, LIFETIMES.c.held)
                .where(LIFETIMES.c.ended.is_(None)))}
            gone = [row.id for uid, row in open_rows.items() if uid not in present]
            same, changed = [], []
            for uid, row in open_rows.items():
                if uid in present:
                    # (a snapshot restores what it holds at its making: its size does not change)
                    if row.kind == "snapshot" or json.loads(row.held) == present[uid].held:
                        same.append(row.id)
                    else:
                        changed.append(row.id)
            for ids in _chunks(gone):
                db.execute(sa.update(LIFETIMES).where(LIFETIMES.c.id.in_(ids)).values(ended=LIFETIMES.c.last_seen))
            for ids in _chunks(same):
                db.execute(sa.update(LIFETIMES).where(LIFETIMES.c.id.in_(ids)).values(last_seen=seen))
            for ids in _chunks(changed):
                db.execute(sa.update(LIFETIMES).where(LIFETIMES.c.id.in_(ids)).values(last_seen=seen, ended=seen))
            changed_ids = set(changed)
            resized = {uid for uid, row in open_rows.items() if row.id in changed_ids}
            new = [uid for uid in present if uid not in open_rows]
            last_end: dict[str, datetime] = {}
            for uids in _chunks(new):  # (an object counted gone and seen again never left: the gap counts)
                for uid, ended in db.execute(sa.select(LIFETIMES.c.uid, sa.func.max(LIFETIMES.c.ended))
                                             .where(LIFETIMES.c.uid.in_(uids)).group_by(LIFETIMES.c.uid)):
                    last_end[uid] = ended
            for uid in [*new, *resized]:
                h = present[uid]
                started = seen if uid in resized else max(_naive(h.started), began, last_end.get(uid) or began)
                db.execute(sa.insert(LIFETIMES).values(
                    uid=uid, kind=h.kind, user=h.user, server=h.server, profile=h.profile, name=h.name,
                    held=json.dumps(h.held, sort_keys=True), started=started, last_seen=seen, ended=None))

    def lifetimes(self, start: datetime, end: datetime, user: str | None = None) -> list[Lifetime]:
        """The lifetimes that overlap [start, end), of one user or of all."""
        query = sa.select(LIFETIMES).where(LIFETIMES.c.started < _naive(end),
                                           sa.or_(LIFETIMES.c.ended.is_(None), LIFETIMES.c.ended > _naive(start)))
        if user is not None:
            query = query.where(LIFETIMES.c.user == user)
        with self.engine.connect() as db:
            rows = db.execute(query).mappings().all()
        return [Lifetime(r["kind"], r["user"], r["server"], r["profile"], r["name"], json.loads(r["held"]),
                         _utc(r["started"]), _utc(r["ended"]) if r["ended"] else None) for r in rows]

    def all_lifetimes(self) -> list[Lifetime]:
        return self.lifetimes(datetime(1970, 1, 1, tzinfo=timezone.utc), datetime(9999, 1, 1, tzinfo=timezone.utc))

    def close(self):
        if self._engine is not None:
            self._engine.dispose()


def report(lifetimes: list[Lifetime], start: datetime, end: datetime, now: datetime, prices: dict,
           by: str) -> list[dict]:
    """Usage and cost in [start, end), one row per user, per profile or per workstation."""
    fields = {"user": ("user",), "profile": ("profile",), "workstation": ("user", "server"),
              "workstation_profile": ("user", "profile")}[by]
    groups: dict[tuple, Usage] = {}
    for lt in lifetimes:
        key = tuple(getattr(lt, name) for name in fields)
        groups.setdefault(key, Usage()).add(usage(lt, start, end, now))
    return [{**dict(zip(fields, key, strict=True)), **used.view(), "cost": cost(used, prices)}
            for key, used in sorted(groups.items())]


# ------------------------------------------------------------------ the service's side
class Meter:
    """The service's recording of lifetimes, and the views and reports made from them."""

    def __init__(self, core):
        self.core = core
        self.ledger = Ledger(core.ssh_keys_db_url)
        self.m_held = Gauge("workstations_held", "What workstations hold now, configured: running machines, their "
                            "CPU cores and memory (GiB); every disk's and snapshot's size (GiB)", ["resource"],
                            registry=core.registry)
        self.m_gpus = Gauge("workstations_gpus_held", "GPUs running machines hold, by model", ["model"],
                            registry=core.registry)
        self.cost_collector = CostCollector()
        core.registry.register(self.cost_collector)

    async def observe(self, now: datetime | None = None):
        caches = self.core._caches()
        if not caches.synced:  # (half-filled caches would end every lifetime they do not show yet)
            return
        held = held_now(caches)
        await asyncio.get_running_loop().run_in_executor(None, self.ledger.observe, held, now or _now())

    async def observe_forever(self, every: float):
        while True:
            try:
                await self.observe()
            except Exception:  # the next round tries again; what was recorded stays
                self.core.log.exception("recording the workstations' lifetimes failed")
            await asyncio.sleep(every)

    async def _lifetimes(self, start: datetime, end: datetime, user: str | None = None) -> list[Lifetime]:
        return await asyncio.get_running_loop().run_in_executor(None, self.ledger.lifetimes, start, end, user)

    async def workstation_cost(self, user: str, server: str, now: datetime | None = None) -> dict:
        """This month's units and cost of the workstation, its rate now, and what it holds now
        (configured capacity) beside what its disks use."""
        now = now or _now()
        month = month_of(now)
        start, end = month_bounds(month)
        used = Usage()
        for lt in await self._lifetimes(start, end, user):
            if lt.server == server:
                used.add(usage(lt, start, end, now))
        held = [h for h in held_now(self.core._caches()) if (h.user, h.server) == (user, server)]
        per_hour = rate(held)
        prices = self.core.prices
        machine = next((h.held for h in held if h.kind == "machine"), None)
        return {"month": month, "currency": prices.get("currency") if prices else None,
                "this_month": {**used.view(), "cost": cost(used, prices)},
                "per_hour": {**per_hour.view(), "cost": cost(per_hour, prices)},
                "held": {"running": machine is not None,
                         "cpu": machine["cpu"] if machine else 0, "memory_gib": machine["memory_gib"] if machine else 0,
                         "gpus": machine["gpus"] if machine else {},
                         "disk_gib": round(sum(h.held["gib"] for h in held if h.kind == "disk"), 3),
                         "snapshot_gib": round(sum(h.held["gib"] for h in held if h.kind == "snapshot"), 3)}}

    async def report(self, month: str | None, by: str, now: datetime | None = None) -> dict:
        now = now or _now()
        month = month or month_of(now)
        start, end = month_bounds(month)
        if by not in ("user", "profile", "workstation"):
            raise ValueError('Group a report "by" user, profile or workstation.')
        rows = report(await self._lifetimes(start, end), start, end, now, self.core.prices, by)
        return {"month": month, "by": by, "currency": (self.core.prices or {}).get("currency"), "rows": rows}

    async def refresh_metrics(self):
        """The capacity gauges from what is held now, and each user's and profile's cost so far."""
        held = held_now(self.core._caches())
        per_hour = rate(held)
        gauges = {"machines": sum(1 for h in held if h.kind == "machine"), "cpu_cores": per_hour.cpu_hours,
                  "memory_gib": per_hour.memory_gib_hours,
                  "disk_gib": sum(h.held["gib"] for h in held if h.kind == "disk"),
                  "snapshot_gib": sum(h.held["gib"] for h in held if h.kind == "snapshot")}
        for name, value in gauges.items():
            self.m_held.labels(name).set(value)
        self.m_gpus.clear()
        for model, count in per_hour.gpu_hours.items():
            self.m_gpus.labels(model).set(count)
        self.cost_collector.totals = await self.cost_totals() if self.core.prices else {}

    async def cost_totals(self, now: datetime | None = None) -> dict[tuple[str, str], float]:
        """Each (user, profile)'s cost since the first record: what workstations_cost_total says."""
        now = now or _now()
        lifetimes = await asyncio.get_running_loop().run_in_executor(None, self.ledger.all_lifetimes)
        out: dict[tuple[str, str], float] = {}
        for row in report(lifetimes, EPOCH, now, now, self.core.prices, "workstation_profile"):
            out[(row["user"], row["profile"])] = (row["cost"] or {}).get("total", 0.0)
        return out


def _now() -> datetime:
    return datetime.now(timezone.utc)


class CostCollector:
    """workstations_cost_total{user, profile}: each one's cost since the first record, in the
    prices' currency (a counter: it only grows, so rate() is what is spent per second)."""

    def __init__(self):
        self.totals: dict[tuple[str, str], float] = {}

    def collect(self):
        family = CounterMetricFamily("workstations_cost", "Cost of the workstations since the first record, "
                                     "in the currency of c.Workstations.prices", labels=["user", "profile"])
        for (user, profile), total in sorted(self.totals.items()):
            family.add_metric([user, profile], total)
        yield family


def csv_report(view: dict) -> str:
    """A report as CSV: one line per row, units then cost (empty without prices)."""
    out = io.StringIO()
    keys = [k for k in ("user", "profile", "server") if view["rows"] and k in view["rows"][0]]
    models = sorted({model for row in view["rows"] for model in row["gpu_hours"]})
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["month", *keys, "cpu_hours", "memory_gib_hours", *(f"gpu_hours:{g}" for g in models),
                     "disk_gib_months", "snapshot_gib_months", "currency", "cost"])
    for row in view["rows"]:
        priced = row["cost"] or {}
        writer.writerow([view["month"], *(_cell(row[k]) for k in keys), row["cpu_hours"], row["memory_gib_hours"],
                         *(row["gpu_hours"].get(g, 0) for g in models), row["disk_gib_months"],
                         row["snapshot_gib_months"], priced.get("currency", ""), priced.get("total", "")])
    return out.getvalue()


def _cell(text: str) -> str:
    """A name users chose, as a spreadsheet shows it and never runs it (=, +, -, @ start formulas)."""
    return "'" + text if text and text[0] in "=+-@\t\r" else text
