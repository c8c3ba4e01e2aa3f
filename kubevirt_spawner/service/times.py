"""The service's clock and its times as JSON writes them (UTC, to the second)."""

from __future__ import annotations

from datetime import datetime, timezone


def now() -> datetime:
    return datetime.now(timezone.utc)


def iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def iso_or_none(moment: datetime | None) -> str | None:
    return None if moment is None else iso(moment)


def parse_time(value: object) -> datetime | None:
    """A time a client or the hub wrote (ISO 8601, UTC when it names no zone); None for anything else."""
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
