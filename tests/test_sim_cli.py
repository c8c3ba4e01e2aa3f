"""`kubevirt-spawner sim` as a command."""

from __future__ import annotations

import os
import subprocess
import sys

import requests
import yaml


def test_sim_command_serves_and_writes_kubeconfig(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kubevirt_spawner.cli", "sim", "--state", str(tmp_path),
                             "--speed", "50", "--guests", "null"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line
        config = yaml.safe_load(open(tmp_path / "kubeconfig"))
        server = config["clusters"][0]["cluster"]["server"]
        assert requests.get(server + "/version/").json()["major"] == "1"
        assert {n["metadata"]["name"] for n in requests.get(server + "/api/v1/nodes").json()["items"]} == \
            {"vm-cpu-1", "vm-cpu-2", "vm-gpu-pci-1", "container-gpu-1"}
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert os.path.exists(tmp_path / "objects.json")


def test_sim_command_names_a_missing_schema_folder(tmp_path):
    res = subprocess.run([sys.executable, "-m", "kubevirt_spawner.cli", "sim", "--state", str(tmp_path),
                          "--schemas", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "does not hold the upstream schemas" in res.stderr


def test_sim_command_refuses_a_bad_speed(tmp_path):
    res = subprocess.run([sys.executable, "-m", "kubevirt_spawner.cli", "sim", "--state", str(tmp_path),
                          "--speed", "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--speed must be positive" in res.stderr
