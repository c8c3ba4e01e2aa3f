"""The configuration disks the simulator's QEMU guests get, read back the way a guest sees them
(the ISO's volume id and its root), against what virt-launcher builds:
- a secret volume: kubevirt pkg/config/config.go (defaultCreateIsoImage: xorrisofs -follow-links
  -volid cfgdata -joliet -rock -graft-points, one graft per entry of kubelet's mount, so kubelet's
  `..data` and `..<timestamp>` entries too: kubernetes pkg/volume/util/atomic_writer.go);
- a cloudInitNoCloud volume: kubevirt pkg/cloud-init/cloud-init.go (volid cidata; meta-data JSON with
  instance-id and local-hostname; user-data; network-config when there is network data), the
  instance-id being the VMI's firmware UUID (cloud-init.go cloudInitUUIDFromVMI): the one KubeVirt's
  VM mutator gave at create, or, for a VM without one, the name's (firmware.go CalculateLegacyUUID)."""

from __future__ import annotations

import json
import subprocess
import uuid

from kubevirt_spawner.sim import isos


def listing(iso: str, into) -> tuple[str, dict[str, str]]:
    """The volume id, and the root's entries: files with their content, directories as `name/`."""
    volid = subprocess.run(["xorriso", "-indev", iso, "-pvd_info"], capture_output=True, text=True, check=True)
    label = next(line.split(":", 1)[1].strip().strip("'") for line in volid.stdout.splitlines()
                 if line.startswith("Volume Id"))
    subprocess.run(["osirrox", "-indev", iso, "-extract", "/", str(into)], capture_output=True, check=True)
    return label, {p.name + ("/" if p.is_dir() else ""): "" if p.is_dir() else p.read_text() for p in into.iterdir()}


def test_a_secret_disk_holds_one_file_per_key_and_kubelets_entries(tmp_path):
    iso = isos.config_disk({"JUPYTERHUB_USER": b"alice", "args.json": b"[]"}, str(tmp_path / "env.iso"))
    label, files = listing(iso, tmp_path / "env")
    assert label == "cfgdata"
    assert files["JUPYTERHUB_USER"] == "alice" and files["args.json"] == "[]"
    assert "..data/" in files and any(name.startswith("..20") for name in files)


def test_a_nocloud_disk(tmp_path):
    vm_uuid = isos.firmware_uuid("alice-workstation")
    assert uuid.UUID(vm_uuid).version == 5 and vm_uuid == isos.firmware_uuid("alice-workstation")
    iso = isos.nocloud_disk(str(tmp_path / "ci.iso"), vm_uuid, "alice-workstation", "#cloud-config\n",
                            "version: 2\n")
    label, files = listing(iso, tmp_path / "ci")
    assert label == "cidata"
    assert json.loads(files["meta-data"]) == {"instance-id": vm_uuid, "local-hostname": "alice-workstation"}
    assert files["user-data"] == "#cloud-config\n" and files["network-config"] == "version: 2\n"
    _, without = listing(isos.nocloud_disk(str(tmp_path / "ci2.iso"), vm_uuid, "a", "#cloud-config\n"), tmp_path / "ci2")
    assert "network-config" not in without
