"""Lifetimes, costs and reports (kubevirt_spawner/service/metering.py): figures checked by hand
with fixed prices and fixed lifetimes, kept in a database across a restart of the service, and
the same in the JSON report, the CSV and the metrics."""

from __future__ import annotations

import asyncio
import csv
import io
import logging
import types
from datetime import datetime, timedelta, timezone

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kubevirt_spawner.service import metering as mt

PRICES = {"currency": "EUR", "cpu_hour": 0.02, "memory_gib_hour": 0.005,
          "gpu_hour": {"nvidia.com/A100-PCIE-40GB": 1.5}, "disk_gib_month": 0.1, "snapshot_gib_month": 0.05}
A100 = "nvidia.com/A100-PCIE-40GB"


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)


def held(uid, kind, started, amounts, user="alice", server="", profile="gpu") -> mt.Held:
    return mt.Held(uid, kind, user, server, profile, uid, amounts, at(started))


MACHINE = held("vmi-1", "machine", "2026-11-30T22:00:00", {"cpu": 2.0, "memory_gib": 4.0, "gpus": {A100: 1}})
DISK = held("pvc-1", "disk", "2026-11-15T00:00:00", {"gib": 60.0})
SNAPSHOT = held("snap-1", "snapshot", "2026-12-01T12:00:00", {"gib": 10.0})
BOB_DISK = held("pvc-2", "disk", "2026-12-01T00:00:00", {"gib": 20.0}, user="bob", profile="small")
NOW = at("2026-12-03T00:00:00")


def record(ledger: mt.Ledger):
    """The ledger begins on Nov 1; alice's machine runs from Nov 30 22:00 to Dec 1 02:00 (seen last
    then), her snapshot lives from Dec 1 12:00 to Dec 2 00:00, her 60 GiB disk from Nov 15 on,
    bob's 20 GiB disk from Dec 1."""
    ledger.observe([], at("2026-11-01T00:00:00"))
    ledger.observe([MACHINE, DISK], at("2026-12-01T02:00:00"))
    ledger.observe([DISK], at("2026-12-01T02:01:00"))  # the machine is gone: it ended at its last sighting
    ledger.observe([DISK, SNAPSHOT, BOB_DISK], at("2026-12-02T00:00:00"))
    ledger.observe([DISK, BOB_DISK], at("2026-12-02T00:00:30"))
    ledger.observe([DISK, BOB_DISK], NOW)


# By hand, December up to Dec 3 00:00: the machine 2 h (Dec 1 00:00-02:00), the disk 48 h, the
# snapshot 12 h, bob's disk 48 h. A GiB-month is 730 GiB-hours.
ALICE_DECEMBER = {"cpu_hours": 4.0, "memory_gib_hours": 8.0, "gpu_hours": {A100: 2.0},
                  "disk_gib_months": round(60 * 48 / 730, 4), "snapshot_gib_months": round(10 * 12 / 730, 4)}
ALICE_DECEMBER_COST = round(4 * 0.02 + 8 * 0.005 + 2 * 1.5 + 60 * 48 / 730 * 0.1 + 10 * 12 / 730 * 0.05, 4)
# November: the machine 2 h (22:00-24:00), the disk from Nov 15: 16 days.
ALICE_NOVEMBER_COST = round(4 * 0.02 + 8 * 0.005 + 2 * 1.5 + 60 * 16 * 24 / 730 * 0.1, 4)


def test_usage_and_cost_of_fixed_lifetimes_match_a_hand_computation(tmp_path):
    ledger = mt.Ledger(f"sqlite:///{tmp_path}/hub.sqlite")
    record(ledger)
    start, end = mt.month_bounds("2026-12")
    rows = mt.report(ledger.lifetimes(start, end), start, end, NOW, PRICES, "user")
    alice = next(r for r in rows if r["user"] == "alice")
    assert {k: alice[k] for k in ALICE_DECEMBER} == ALICE_DECEMBER
    assert alice["cost"]["total"] == ALICE_DECEMBER_COST and alice["cost"]["currency"] == "EUR"
    assert alice["cost"]["gpu"] == 3.0 and alice["cost"]["cpu"] == 0.08
    bob = next(r for r in rows if r["user"] == "bob")
    assert bob["disk_gib_months"] == round(20 * 48 / 730, 4) and bob["cpu_hours"] == 0
    by_profile = mt.report(ledger.lifetimes(start, end), start, end, NOW, PRICES, "profile")
    assert [r["profile"] for r in by_profile] == ["gpu", "small"]
    november = mt.report(ledger.lifetimes(*mt.month_bounds("2026-11")), *mt.month_bounds("2026-11"), NOW, PRICES, "user")
    assert [(r["user"], r["cost"]["total"]) for r in november] == [("alice", ALICE_NOVEMBER_COST)]
    # Without prices: the same units, no cost.
    assert mt.report(ledger.lifetimes(start, end), start, end, NOW, {}, "user")[0]["cost"] is None


def test_lifetimes_outlive_a_restart_and_end_at_their_last_sighting(tmp_path):
    """The service restarts (a new Ledger on the same database) while the disk stays and the machine
    went during its downtime: the machine is counted up to the last time it was seen, never beyond."""
    url = f"sqlite:///{tmp_path}/hub.sqlite"
    before = mt.Ledger(url)
    before.observe([], at("2026-11-01T00:00:00"))
    before.observe([MACHINE, DISK], at("2026-12-01T01:00:00"))
    before.close()
    after = mt.Ledger(url)  # (down for an hour; the machine stopped meanwhile)
    after.observe([DISK], at("2026-12-01T02:00:00"))
    lifetimes = {lt.kind: lt for lt in after.all_lifetimes()}
    assert lifetimes["machine"].ended == at("2026-12-01T01:00:00")
    assert lifetimes["disk"].ended is None and lifetimes["disk"].started == at("2026-11-15T00:00:00")
    used = mt.usage(lifetimes["machine"], *mt.month_bounds("2026-12"), at("2026-12-01T02:00:00"))
    assert used.cpu_hours == 2.0  # (Dec 1 00:00 to 01:00, 2 CPUs)


def test_nothing_is_charged_before_the_ledger_began_and_the_past_keeps_its_size(tmp_path):
    """A disk made before the service recorded anything counts from the ledger's start; a disk
    grown counts at its old size until then (a new lifetime from the growth); a snapshot keeps the
    size it was made with; an object counted gone and seen again (the same uid: it never left)
    counts the time between too."""
    ledger = mt.Ledger(f"sqlite:///{tmp_path}/hub.sqlite")
    ledger.observe([DISK, SNAPSHOT], at("2026-12-02T00:00:00"))  # (the ledger begins: the disk is from Nov 15)
    grown = held("pvc-1", "disk", "2026-11-15T00:00:00", {"gib": 120.0})
    shrunk_snapshot = held("snap-1", "snapshot", "2026-12-01T12:00:00", {"gib": 0.0})  # (its claims went)
    ledger.observe([grown, shrunk_snapshot], at("2026-12-02T12:00:00"))
    ledger.observe([grown, shrunk_snapshot], at("2026-12-03T00:00:00"))
    ledger.observe([], at("2026-12-03T00:01:00"))  # (counted gone ...)
    ledger.observe([grown], at("2026-12-03T06:00:00"))  # (... and back)
    start, end = mt.month_bounds("2026-12")
    used = mt.Usage()
    for lt in ledger.lifetimes(start, end):
        used.add(mt.usage(lt, start, end, at("2026-12-03T06:00:00")))
    # the disk: 60 GiB for 12 h, 120 GiB for 12 h, and 6 h more from its last sighting to its
    # return; the snapshot: 10 GiB for 24 h
    assert used.disk_gib_months == pytest.approx((60 * 12 + 120 * 18) / 730)
    assert used.snapshot_gib_months == pytest.approx(10 * 24 / 730)


def test_the_rate_now_is_what_is_held_priced_per_hour():
    per_hour = mt.rate([MACHINE, DISK, SNAPSHOT])
    assert (per_hour.cpu_hours, per_hour.memory_gib_hours, per_hour.gpu_hours) == (2.0, 4.0, {A100: 1.0})
    assert mt.cost(per_hour, PRICES)["total"] == round(0.04 + 0.02 + 1.5 + 60 / 730 * 0.1 + 10 / 730 * 0.05, 4)


def test_the_csv_and_the_metrics_agree_with_the_report(tmp_path):
    registry = CollectorRegistry()
    core = types.SimpleNamespace(prices=PRICES, ssh_keys_db_url=f"sqlite:///{tmp_path}/hub.sqlite", registry=registry,
                                 log=logging.getLogger("test"),
                                 _caches=lambda: types.SimpleNamespace(vms={}, vmis={}, pvcs={}, snapshots={}))
    meter = mt.Meter(core)
    record(meter.ledger)
    view = asyncio.run(meter.report("2026-12", "user", now=NOW))
    rows = list(csv.DictReader(io.StringIO(mt.csv_report(view))))
    assert [(r["month"], r["user"], float(r["cost"]), r["currency"]) for r in rows] == [
        ("2026-12", "alice", ALICE_DECEMBER_COST, "EUR"), ("2026-12", "bob", round(20 * 48 / 730 * 0.1, 4), "EUR")]
    assert float(rows[0][f"gpu_hours:{A100}"]) == 2.0 and float(rows[0]["disk_gib_months"]) == \
        ALICE_DECEMBER["disk_gib_months"]
    totals = asyncio.run(meter.cost_totals(now=NOW))
    assert totals[("alice", "gpu")] == round(ALICE_NOVEMBER_COST + ALICE_DECEMBER_COST, 4)
    meter.cost_collector.totals = totals
    text = generate_latest(registry).decode()
    assert f'workstations_cost_total{{profile="gpu",user="alice"}} {totals[("alice", "gpu")]}' in text


@pytest.mark.parametrize("prices,why", [
    ({"cpu": 1}, "cpu is not one of"), ({"cpu_hour": -1}, "cpu_hour must be a number"),
    ({"gpu_hour": 2}, "maps GPU resource names"), ({"currency": ""}, "currency"),
    ({"disk_gib_month": True}, "disk_gib_month must be a number"),
])
def test_bad_prices_are_refused_with_a_sentence(prices, why):
    with pytest.raises(ValueError, match=why):
        mt.check_prices(prices)


def test_months_are_checked():
    assert mt.month_bounds("2026-12") == (at("2026-12-01T00:00:00"), at("2027-01-01T00:00:00"))
    assert mt.previous_month("2026-01") == "2025-12"
    with pytest.raises(ValueError, match="YYYY-MM"):
        mt.month_bounds("December")
    assert mt.month_of(at("2026-12-31T23:59:59") + timedelta(seconds=1)) == "2027-01"


def test_names_in_the_csv_never_run_as_formulas():
    """Users choose their server names (and, with some authenticators, their user names): a name a
    spreadsheet would take for a formula is written as text."""
    view = {"month": "2026-12", "rows": [{"user": "=HYPERLINK(\"http://x\")", "server": "@sum", "cpu_hours": 1.0,
                                          "memory_gib_hours": 0, "gpu_hours": {}, "disk_gib_months": 0,
                                          "snapshot_gib_months": 0, "cost": None}]}
    row = list(csv.reader(io.StringIO(mt.csv_report(view))))[1]
    assert row[1:3] == ["'=HYPERLINK(\"http://x\")", "'@sum"]


def test_nothing_is_recorded_from_caches_not_yet_synced(tmp_path):
    """A restarted service's first moments: half-filled caches would end every lifetime they do not
    show yet; the round is skipped instead."""
    caches = types.SimpleNamespace(synced=False, vms={}, vmis={}, pvcs={}, snapshots={})
    core = types.SimpleNamespace(prices={}, ssh_keys_db_url=f"sqlite:///{tmp_path}/hub.sqlite",
                                 registry=CollectorRegistry(), log=logging.getLogger("test"), _caches=lambda: caches)
    meter = mt.Meter(core)
    meter.ledger.observe([DISK], at("2026-12-01T00:00:00"))
    asyncio.run(meter.observe(at("2026-12-02T00:00:00")))
    assert [lt.ended for lt in meter.ledger.all_lifetimes()] == [None]
