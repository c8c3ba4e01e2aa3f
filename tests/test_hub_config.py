"""Both hub configs (production, and the demo's, which is package data) load and give a spawner that passes its own configuration checks."""

from pathlib import Path

from traitlets.config.loader import PyFileConfigLoader

from kubevirt_spawner.demo import DEMO_CONFIG
from kubevirt_spawner.spawner import KubeVirtSpawner

HUB_CONFIG = Path(__file__).resolve().parents[1] / "hub-config"


def load(path: Path, env, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return PyFileConfigLoader(path.name, path=str(path.parent)).load_config()


def test_production_config(monkeypatch):
    """The hub's namespace comes from POD_NAMESPACE, which Zero-to-JupyterHub's hub Deployment sets
    from the downward API (jupyterhub/templates/hub/deployment.yaml)."""
    c = load(HUB_CONFIG / "jupyterhub_config.py", {"POD_NAMESPACE": "hub-prod", "CLUSTER_DOMAIN": "corp.example"},
             monkeypatch)
    assert c.JupyterHub.spawner_class == "kubevirt"
    assert c.JupyterHub.hub_connect_url == "http://hub.hub-prod.svc.corp.example:8081"
    assert c.ConfigurableHTTPProxy.api_url == "http://proxy-api.hub-prod.svc.corp.example:8001"
    spawner = KubeVirtSpawner(config=c)
    assert [p["slug"] for p in spawner._profiles()] == ["cpu-4", "gpu-a100-1"]
    assert spawner.url_mode == "dns" and spawner.kubeconfig is None and spawner.cluster_domain == "corp.example"


def test_local_demo_config(monkeypatch, tmp_path):
    env = {"KUBEVIRT_DEMO_STATE": str(tmp_path), "KUBEVIRT_DEMO_PORT": "8000", "KUBEVIRT_DEMO_HUB_PORT": "8081",
           "CONFIGPROXY_API_URL": "http://127.0.0.1:8001", "KUBEVIRT_DEMO_ADMIN_TOKEN": "x",
           "KUBEVIRT_SPAWNER_KUBECONFIG": str(tmp_path / "kubeconfig"), "KUBEVIRT_DEMO_EXTRA_CONFIG": ""}
    c = load(DEMO_CONFIG, env, monkeypatch)
    spawner = KubeVirtSpawner(config=c)
    assert spawner.url_mode == "cluster-ip"
    assert [p["slug"] for p in spawner._profiles()] == ["cpu", "gpu-a100-1", "gpu-a100-2"]
