"""How long a workstation takes to boot: the golden image under QEMU, as the simulator's `qemu`
guests boot it (through the VM's firmware, KubeVirt's device layout), behind the real hub and proxy.

    python bench/boot.py [--image DIR] [--firmware bios,efi] [--results bench/RESULTS.md]

For each firmware it starts one user's workstation twice: a clone's first boot (cloud-init makes
its identity, the workstation unit creates the user) and a later boot (stop, start). Each boot
reports, on the host's clock from QEMU's start (the console log appearing):
  - firmware to GRUB, GRUB to kernel (the kernel's banner on the serial console);
  - the kernel's, the initrd's and userspace's share as systemd-analyze gives them, and the
    critical chain of kubevirt-workstation.service (read in the guest through Jupyter);
  - QEMU start to Jupyter answering through the hub (JupyterLab's page via the proxy: 200);
  - and the whole start as the hub sees it (from the start request, cloning included).
KVM is used where a KVM guest boots here (the simulator probes it), else TCG. Numbers move with
what else the machine does: run it alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "e2e"), str(REPO / "tests")]

from conftest import E2E_SPEED, SERVICE_API, Hub  # noqa: E402  (the e2e harness: hub, proxy, simulator)

from simtools import start_sim, wait_for  # noqa: E402

CONFIG = """
import os
c.KubeVirtSpawner.hub_connect_url = "http://10.0.2.1:" + os.environ["KUBEVIRT_DEMO_HUB_PORT"]
c.KubeVirtSpawner.workstations_url = "http://10.0.2.1:" + os.environ["KUBEVIRT_DEMO_SERVICE_PORT"] + "/services/workstations/"
c.KubeVirtSpawner.root_disk_size = "6Gi"
c.KubeVirtSpawner.workspace_disk_size = "2Gi"
c.KubeVirtSpawner.start_timeout = 900
c.KubeVirtSpawner.http_timeout = 840
c.KubeVirtSpawner.profile_list = [
    {"display_name": "BIOS", "slug": "bios", "default": True,
     "kubevirt_override": {"cpu_guarantee": 2, "mem_guarantee": "2G"}},
    {"display_name": "EFI", "slug": "efi",
     "kubevirt_override": {"cpu_guarantee": 2, "mem_guarantee": "2G", "firmware": "efi"}},
]
"""
MARKS = {"grub": ("Loading Linux",), "kernel": ("Linux version",),
         "userspace": ("Welcome to \x1b[1m",), "login": (" login: ",)}  # (systemd's banner, in bold)


class ConsoleWatch(threading.Thread):
    """When each mark first shows on the serial console, on the host's clock (the file is polled
    every 50 ms; its appearance is QEMU's start)."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.seen, self.done = path, {}, threading.Event()

    def run(self):
        offset, text = 0, ""
        while not self.done.is_set():
            if self.path.exists():
                self.seen.setdefault("qemu", time.monotonic())
                with open(self.path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                text += chunk.decode(errors="replace")
                now = time.monotonic()
                for mark, needles in MARKS.items():
                    if mark not in self.seen and any(n in text for n in needles):
                        self.seen[mark] = now
            time.sleep(0.05)


def lab_answers(hub: Hub, user: str) -> bool:
    """JupyterLab's page from the user's server, through the proxy (until it answers, the proxy
    sends /user/NAME/ to the hub, which redirects to its spawn-pending page)."""
    r = hub.http.get(f"{hub.url}/user/{user}/lab", timeout=30, allow_redirects=False)
    return r.status_code == 200 and "JupyterLab" in r.text


def boot(hub: Hub, state: Path, user: str, profile: str) -> dict:
    ns, vm = f"notebook-{user}", f"{user}-workstation"
    console = state / "guests" / f"{ns}_{vm}.console.log"
    console.unlink(missing_ok=True)
    watch = ConsoleWatch(console)
    watch.start()
    began = time.monotonic()
    r = hub.request_start(user, "", profile)
    assert r.status_code in (201, 202), r.text
    wait_for(lambda: lab_answers(hub, user), 900, interval=0.2, what="JupyterLab through the hub")
    lab = time.monotonic()
    hub.wait_ready(user, "", 120)
    qemu = subprocess.run(["pgrep", "-af", f"-name {vm} "], capture_output=True, text=True).stdout
    watch.done.set()
    seen = watch.seen
    q = seen.get("qemu", began)

    def since(mark, start=q):
        return round(seen[mark] - start, 1) if mark in seen and start is not None else None
    analyze = hub.execute(user, "import subprocess\nfor a in (['systemd-analyze'], ['systemd-analyze', "
                          "'critical-chain', 'kubevirt-workstation.service'], ['sudo', 'journalctl', '-b', "
                          "'-u', 'kubevirt-workstation', '-o', 'short-monotonic', '--no-pager']):\n"
                          "    print(subprocess.run(a, capture_output=True, text=True).stdout)")
    return {"firmware_to_grub_s": since("grub"), "grub_to_kernel_s": since("kernel", seen.get("grub")),
            "kernel_to_userspace_s": since("userspace", seen.get("kernel")), "qemu_to_login_prompt_s": since("login"),
            "qemu_to_jupyter_through_hub_s": round(lab - q, 1), "start_request_to_jupyter_s": round(lab - began, 1),
            "systemd_analyze": analyze.strip(), "accelerator": "KVM" if "accel=kvm" in qemu else "TCG"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", help="a golden image directory (default: build.sh's, built if needed)")
    p.add_argument("--firmware", default="bios,efi")
    p.add_argument("--results", help="append the numbers to this Markdown file")
    a = p.parse_args()
    image = a.image or subprocess.run(["bash", str(REPO / "deploy" / "golden-image" / "build.sh")], check=True,
                                      capture_output=True, text=True).stdout.strip().splitlines()[-1]
    work = Path(tempfile.mkdtemp(prefix="boot-bench-"))
    sim = start_sim(work / "cluster", speed=E2E_SPEED, guest_mode="qemu", golden_image=image)
    hub = Hub(work / "hub", sim, extra_config=CONFIG).start()
    results = {}
    try:
        wait_for(lambda: requests.get(f"{hub.url}{SERVICE_API}/workstations", timeout=5).status_code == 401, 60,
                 what="the workstations service")
        for firmware in a.firmware.split(","):
            user = f"boot-{firmware}"
            hub.ensure_user(user)
            first = boot(hub, work / "cluster", user, firmware)
            hub.stop_server(user, timeout=300)
            later = boot(hub, work / "cluster", user, firmware)
            hub.stop_server(user, timeout=300)
            results[firmware] = {"first boot": first, "later boot": later}
    finally:
        hub.close()
        sim.stop()
    meta = json.loads((Path(image) / "image.json").read_text())
    accel = next(iter({r["accelerator"] for boots in results.values() for r in boots.values()}), "?")
    print(json.dumps({"image": meta.get("suite"), "accelerator": accel, "results": results}, indent=1))
    if a.results:
        write_results(Path(a.results), meta, results)
    return 0


def write_results(path: Path, meta: dict, results: dict):
    rows = ["| firmware | boot | firmware to GRUB | GRUB to kernel | kernel to userspace | QEMU to login prompt "
            "| QEMU to Jupyter through the hub | start request to Jupyter |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for firmware, boots in results.items():
        for kind, r in boots.items():
            rows.append(f"| {firmware} | {kind} | {r['firmware_to_grub_s']} s | {r['grub_to_kernel_s']} s | "
                        f"{r['kernel_to_userspace_s']} s | {r['qemu_to_login_prompt_s']} s | "
                        f"{r['qemu_to_jupyter_through_hub_s']} s | {r['start_request_to_jupyter_s']} s |")
    chains = "\n\n".join(f"{firmware}, {kind}:\n\n```\n{r['systemd_analyze']}\n```" for firmware, boots in results.items()
                         for kind, r in boots.items() if kind == "later boot")
    with open(path, "a") as f:
        f.write(f"\n## Boot time: `python bench/boot.py` ({datetime.date.today()}, {platform.node()}, "
                f"{platform.processor() or platform.machine()}, {meta.get('suite')} image, "
                f"{next(iter(results.values()))['later boot']['accelerator']})\n\n" + "\n".join(rows) +
                "\n\n" + chains + "\n")


if __name__ == "__main__":
    sys.exit(main())
