"""`kubevirt-spawner sim` as a command."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import requests
import yaml
from kubernetes import client

from kube_objects import KV, vm
from simtools import api_client, api_client_for, start_sim


def test_sim_command_serves_and_writes_kubeconfig(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kubevirt_spawner.cli", "sim", "--state", str(tmp_path),
                             "--speed", "50", "--guests", "null"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on https://127.0.0.1:" in line
        config = yaml.safe_load(open(tmp_path / "kubeconfig"))
        server = config["clusters"][0]["cluster"]["server"]
        # Anyone may read the version (system:public-info-viewer); the rest needs the kubeconfig's token.
        ca = str(tmp_path / "pki" / "ca.crt")
        assert requests.get(server + "/version/", verify=ca).json()["major"] == "1"
        assert requests.get(server + "/api/v1/nodes", verify=ca).status_code == 403
        nodes = client.CoreV1Api(api_client_for(str(tmp_path / "kubeconfig"))).list_node().items
        assert {n.metadata.name for n in nodes} == {"vm-cpu-1", "vm-cpu-2", "vm-gpu-pci-1", "container-gpu-1"}
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


def test_the_simulator_runs_without_the_upstream_schemas_and_says_so_once(tmp_path, monkeypatch, caplog):
    """The schemas stay outside the project: without them the simulator starts anyway, warns once,
    and keeps its own admission rules (here: runStrategy and running are mutually exclusive, as
    KubeVirt's VM admitter says in pkg/virt-api/webhooks/validating-webhook/admitters/vms-admitter.go)."""
    from kubernetes import client

    from kubevirt_spawner.sim import schema
    monkeypatch.delenv("KUBEVIRT_SCHEMAS_DIR", raising=False)
    monkeypatch.setattr(schema, "schemas_dir", lambda: None)
    with caplog.at_level(logging.WARNING):
        sim = start_sim(tmp_path, guest_mode="null")
    try:
        assert not sim.cluster.schemas.available
        warnings = [r.getMessage() for r in caplog.records if "schemas were not found" in r.getMessage()]
        assert len(warnings) == 1 and "own admission rules only" in warnings[0]
        custom = client.CustomObjectsApi(api_client(sim))
        client.CoreV1Api(api_client(sim)).create_namespace({"metadata": {"name": "plain"}})
        custom.create_namespaced_custom_object(*KV, "plain", "virtualmachines", vm("ok", "disk"))
        both = vm("both", "disk")
        both["spec"]["running"] = False
        with pytest.raises(client.ApiException) as refused:
            custom.create_namespaced_custom_object(*KV, "plain", "virtualmachines", both)
        assert refused.value.status == 422 and "mutually exclusive" in refused.value.body
    finally:
        sim.stop()


def test_sim_command_refuses_qemu_guests_without_a_golden_image_and_an_image_for_other_guests(tmp_path):
    cli = [sys.executable, "-m", "kubevirt_spawner.cli", "sim", "--state", str(tmp_path / "state")]
    res = subprocess.run([*cli, "--guests", "qemu"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "qemu guests boot a golden image" in res.stderr
    res = subprocess.run([*cli, "--guests", "qemu", "--golden-image", str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "no readable image.json" in res.stderr
    res = subprocess.run([*cli, "--golden-image", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--golden-image is for --guests qemu" in res.stderr
    assert not (tmp_path / "state" / "objects.json").exists()


def test_the_demo_without_jupyterlab_names_the_extra_and_starts_nothing(tmp_path, monkeypatch, capsys):
    """`pip install kubevirt-spawner` alone has no JupyterLab (it is in the [guest] and [demo]
    extras): a demo started so would land its users on a 404, so it refuses first."""
    import importlib.util

    from kubevirt_spawner.cli import main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jupyterlab" else real(name, *a))
    state = tmp_path / "demo"
    assert main(["demo", "--state", str(state)]) == 2
    said = capsys.readouterr().err
    assert said == ("kubevirt-spawner demo: the demo's workstations run JupyterLab, and jupyterlab is not installed: "
                    "pip install 'kubevirt-spawner[demo]'\n")
    assert not state.exists()


def test_the_demo_without_jsonschema_names_the_extra_and_starts_nothing(tmp_path, monkeypatch, capsys):
    """jsonschema is the simulator's alone, so only the [demo] extra brings it: a demo started
    without it refuses with the extra's name before it writes anything."""
    import importlib.util

    from kubevirt_spawner.cli import main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jsonschema" else real(name, *a))
    state = tmp_path / "demo"
    assert main(["demo", "--state", str(state)]) == 2
    said = capsys.readouterr().err
    assert said == ("kubevirt-spawner demo: the demo's simulator checks every object against KubeVirt's schemas, "
                    "and jsonschema is not installed: pip install 'kubevirt-spawner[demo]'\n")
    assert not state.exists()


# The hub's own install (`pip install kubevirt-spawner`) lacks what only the simulator uses.
WITHOUT_SIMULATOR_DEPENDENCIES = "import sys; sys.modules['jsonschema'] = None; "


def test_the_hub_side_imports_without_the_simulators_dependencies():
    """The spawner (the hub's entry point), the workstations service and the command line import
    with jsonschema unavailable: a production hub does not install the simulator's dependencies."""
    code = WITHOUT_SIMULATOR_DEPENDENCIES + (
        "from importlib.metadata import entry_points; "
        "spawner = entry_points(group='jupyterhub.spawners')['kubevirt'].load(); "
        "import kubevirt_spawner.service.web, kubevirt_spawner.cli, kubevirt_spawner.acceptance; "
        "print(spawner.__name__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "KubeVirtSpawner", res.stderr


def test_the_sim_command_without_its_dependencies_names_the_extra(tmp_path):
    code = WITHOUT_SIMULATOR_DEPENDENCIES + (
        f"from kubevirt_spawner.cli import main; sys.exit(main(['sim', '--state', {str(tmp_path / 'state')!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr == ("kubevirt-spawner sim: the simulator needs jsonschema, which is not installed: "
                          "pip install 'kubevirt-spawner[demo]'\n")
    assert not (tmp_path / "state").exists()
