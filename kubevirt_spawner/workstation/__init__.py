"""The lifecycle of one workstation: provision, start (resume), wait, stop and retire.

Used by the spawner and by the hub service. Every wait reads the shared caches (`reflector.py`);
API requests are only made to change something. Failures a user can act on are `WorkstationError`
(a JupyterHub `SpawnException`): one sentence that says what happened and what to do, and a short
reason. Everything is logged through the logger the caller gives (the hub's), each line naming the
workstation.
"""

from __future__ import annotations

from ..clonegate import CloneGate
from .base import (
    ALREADY_RUNNING,
    ANNOTATION_SPEC_HASH,
    CHECK_ONLY,
    COPY_ON_WRITE_PHASES,
    SNAPSHOT,
    STALL_CHECK_SECONDS,
    WAITING_FOR_CONSUMER,
    Report,
    Settings,
    VmHook,
    WorkstationBase,
    WorkstationError,
    WorkstationLog,
    WorkstationState,
    name_taken,
    refusals_explained,
    spec_hash,
    wait_synced,
)
from .snapshots import Snapshots

__all__ = ['CloneGate', 'ALREADY_RUNNING', 'ANNOTATION_SPEC_HASH', 'CHECK_ONLY', 'COPY_ON_WRITE_PHASES', 'SNAPSHOT', 'STALL_CHECK_SECONDS', 'WAITING_FOR_CONSUMER', 'Report', 'Settings', 'VmHook', 'WorkstationBase', 'WorkstationError', 'WorkstationLog', 'WorkstationState', 'name_taken', 'refusals_explained', 'spec_hash', 'wait_synced', "Workstation"]


class Workstation(Snapshots):
    """One user's workstation, in layers that each use only those below them: the names, cached
    views and object making they share (base.py), its disks (disks.py: resize, reclaim policy, reset
    of the root disk), what a start provisions (provisioning.py), its lifecycle (lifecycle.py: start,
    stop, retire) and its snapshots and restores (snapshots.py)."""
