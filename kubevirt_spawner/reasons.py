"""Why a workstation action failed, as the user and the hub's log see it: one `Reason` for every
failure a user can act on (`workstation.WorkstationError`, a JupyterHub `SpawnException`).

The reasons were bare strings at each raising site, so a typo made a new reason, nothing listed
them, and nobody could say what one means. Here each is a member whose value is the string the hub
always logged and reported (so logs, JupyterHub's metrics labels and its behaviour are unchanged:
a `StrEnum` member is that string), with a sentence saying when it happens and what the user or
administrator does; docs/failures.md is generated from them (docs/generate.py).

Pure: imports nothing of the product, so any module may use it."""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """The short label of a user-facing failure; its value is what logs and metrics show."""

    BAD_INPUT = "bad-input"
    BOOT_FAILED = "boot-failed"
    CLONE_FAILED = "clone-failed"
    CLUSTER_UNAVAILABLE = "cluster-unavailable"
    DISK_IN_USE = "disk-in-use"
    DISK_MISSING = "disk-missing"
    FORBIDDEN = "forbidden"
    GPU_UNAVAILABLE = "gpu-unavailable"
    KEPT_FOR_EARLIER_ACCOUNT = "kept-for-earlier-account"
    LOST_NODE = "lost-node"
    NAME_TAKEN = "name-taken"
    NO_MACHINE = "no-machine"
    NO_SNAPSHOT = "no-snapshot"
    OPERATION_RUNNING = "operation-running"
    PROFILE = "profile"
    RECLAIM_POLICY = "reclaim-policy"
    RESTORE_FAILED = "restore-failed"
    RESTORE_STUCK = "restore-stuck"
    RUNNING = "running"
    SHARED_DATA = "shared-data"
    SNAPSHOT_EXISTS = "snapshot-exists"
    SNAPSHOT_FAILED = "snapshot-failed"
    SNAPSHOT_HOLDS_SHARED_DATA = "snapshot-holds-shared-data"
    SNAPSHOT_NOT_READY = "snapshot-not-ready"
    STOPPED_WHILE_STARTING = "stopped-while-starting"
    TIMEOUT = "timeout"
    VM_SPEC = "vm-spec"

    @property
    def description(self) -> str:
        """When this failure happens and what the user or administrator does about it."""
        return DESCRIPTIONS[self]


# One sentence each (docs/failures.md shows them; tests/test_reasons.py wants one for every member).
DESCRIPTIONS: dict[Reason, str] = {
    Reason.BAD_INPUT:
        "A request carried a value the hub refuses (a snapshot name or note it cannot take); the user corrects "
        "it and asks again.",
    Reason.BOOT_FAILED:
        "The virtual machine shut down while it was booting; the user starts it again, and if it keeps happening "
        "an administrator reads the machine's events and console.",
    Reason.CLONE_FAILED:
        "Cloning the system disk from the golden image, or making an extra disk, failed or made no progress; an "
        "administrator checks the golden image, the profile's disks and the storage.",
    Reason.CLUSTER_UNAVAILABLE:
        "The hub could not read the workstation's state from the cluster in time (its caches are not synced); "
        "the user tries again in a few minutes, an administrator checks the hub's log.",
    Reason.DISK_IN_USE:
        "The workstation's disk is attached to another virtual machine; the user or an administrator stops that "
        "machine first.",
    Reason.DISK_MISSING:
        "The workstation's machine exists but its system disk is gone; an administrator restores it from a "
        "snapshot or resets the user's system.",
    Reason.FORBIDDEN:
        "The cluster refused the hub a request it is not allowed to make; an administrator grants the permission "
        "the hub's log names to the hub's ServiceAccount (deploy/rbac/).",
    Reason.GPU_UNAVAILABLE:
        "No GPU of the kind asked for is free and gpu_unavailable is \"fail\"; the user tries again later or "
        "chooses a profile without a GPU.",
    Reason.KEPT_FOR_EARLIER_ACCOUNT:
        "Disks or a machine kept from an earlier account of the same name wait in the namespace; an administrator "
        "confirms they are this account's with the annotation the hub's log names.",
    Reason.LOST_NODE:
        "The disk is still attached on a node that stopped responding; an administrator confirms the node is "
        "fenced (taint node.kubernetes.io/out-of-service) so it can start elsewhere.",
    Reason.NAME_TAKEN:
        "An object under one of the workstation's names exists and is not the workstation's, so nothing was done; "
        "an administrator renames or removes that object.",
    Reason.NO_MACHINE:
        "A snapshot, restore or reset was asked of a workstation that has never been started; the user starts it "
        "once first.",
    Reason.NO_SNAPSHOT:
        "The snapshot named to restore or delete does not exist; the user chooses one from the list of their "
        "snapshots.",
    Reason.OPERATION_RUNNING:
        "A restore or reset is changing the workstation, so a start or another operation waits, and a deletion "
        "happens when it ends; the user tries again when it is done.",
    Reason.PROFILE:
        "The profile list or the chosen profile or options cannot be used (unknown, not open to the user, invalid, "
        "failing); the user chooses another, an administrator fixes profile_list.",
    Reason.RECLAIM_POLICY:
        "The disks' volumes could not be set back to keep their data after a restore; an administrator sets "
        "persistentVolumeReclaimPolicy to Retain on the PersistentVolumes named.",
    Reason.RESTORE_FAILED:
        "Restoring a snapshot failed or was cancelled, and the message says whether a disk was replaced; the user "
        "restores it again, and asks an administrator if it keeps failing.",
    Reason.RESTORE_STUCK:
        "A VirtualMachineRestore that did not finish locks the machine, so it cannot start or be deleted; an "
        "administrator lets it finish or deletes it, and the snapshot is restored again.",
    Reason.RUNNING:
        "A restore or a system reset needs the workstation stopped; the user stops it first.",
    Reason.SHARED_DATA:
        "A shared data claim the profile mounts is missing, is a workstation's disk or is a Block device; an "
        "administrator makes or fixes the claim or takes it out of the profile.",
    Reason.SNAPSHOT_EXISTS:
        "A snapshot of that name exists already; the user chooses another name.",
    Reason.SNAPSHOT_FAILED:
        "KubeVirt reported the snapshot as failed (its error is in the message); the user tries again, an "
        "administrator checks the VolumeSnapshotClass and the storage.",
    Reason.SNAPSHOT_HOLDS_SHARED_DATA:
        "The snapshot also holds shared data, which a restore would put back for everyone; an administrator "
        "moves the shared data to a StorageClass without a VolumeSnapshotClass.",
    Reason.SNAPSHOT_NOT_READY:
        "The snapshot is not ready to be restored yet; the user tries again when it is.",
    Reason.STOPPED_WHILE_STARTING:
        "The workstation was stopped while it was starting (by the user, an administrator or an idle stop); the "
        "user starts it again.",
    Reason.TIMEOUT:
        "A start, snapshot, disk reset or the hub did not finish within its time; the user tries again later, an "
        "administrator looks at what the message says it waited for.",
    Reason.VM_SPEC:
        "The cluster refuses the VirtualMachine the hub's settings make, or modify_vm_hook failed or returned "
        "another object; an administrator fixes the profile, extra_vm_spec or the hook.",
}
