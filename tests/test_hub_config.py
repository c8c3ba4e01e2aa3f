"""Both hub configs (production, and the demo's, which is package data) load, give a spawner that
passes its own configuration checks, and register the workstations service."""

from pathlib import Path

import pytest
from traitlets import TraitError
from traitlets.config.loader import PyFileConfigLoader

from kubevirt_spawner.demo import DEMO_CONFIG
from kubevirt_spawner.spawner import KubeVirtSpawner

HUB_CONFIG = Path(__file__).resolve().parents[1] / "hub-config"
PUBLIC = {"SUBDOMAIN_HOST": "https://jupyter.corp.example"}  # users' pages on subdomains of it


def load(path: Path, env, monkeypatch):
    """The config as `jupyterhub --config PATH` loads it (the running JupyterHub knows its file)."""
    from jupyterhub.app import JupyterHub
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    JupyterHub.instance(config_file=str(path))
    try:
        return PyFileConfigLoader(path.name, path=str(path.parent)).load_config()
    finally:
        JupyterHub.clear_instance()


def test_production_config(monkeypatch):
    """The hub's namespace comes from POD_NAMESPACE, which Zero-to-JupyterHub's hub Deployment sets
    from the downward API (jupyterhub/templates/hub/deployment.yaml)."""
    c = load(HUB_CONFIG / "jupyterhub_config.py", {"POD_NAMESPACE": "hub-prod", "CLUSTER_DOMAIN": "corp.example", **PUBLIC},
             monkeypatch)
    assert c.JupyterHub.spawner_class == "kubevirt"
    assert c.JupyterHub.hub_connect_url == "http://hub.hub-prod.svc.corp.example:8081"
    assert c.ConfigurableHTTPProxy.api_url == "http://proxy-api.hub-prod.svc.corp.example:8001"
    spawner = KubeVirtSpawner(config=c)
    assert [p["slug"] for p in spawner._profiles()] == ["cpu-4", "gpu-a100-pcie-40gb-1"]
    assert spawner.url_mode == "dns" and spawner.kubeconfig is None and spawner.cluster_domain == "corp.example"
    # users' pages on their own subdomains, the hub's cookies out of their reach (__Host-)
    assert c.JupyterHub.subdomain_host == "https://jupyter.corp.example"
    assert c.JupyterHub.cookie_host_prefix_enabled is True


def test_the_production_config_refuses_a_hub_without_subdomains(monkeypatch):
    """Issue 30, item 1: without subdomains a user's page acts with its visitors' hub logins."""
    monkeypatch.delenv("SUBDOMAIN_HOST", raising=False)
    with pytest.raises(TraitError, match="c.JupyterHub.subdomain_host is not set"):
        load(HUB_CONFIG / "jupyterhub_config.py", {"POD_NAMESPACE": "hub-prod"}, monkeypatch)


def test_local_demo_config(monkeypatch, tmp_path):
    env = {"KUBEVIRT_DEMO_STATE": str(tmp_path), "KUBEVIRT_DEMO_PORT": "8000", "KUBEVIRT_DEMO_HUB_PORT": "8081",
           "CONFIGPROXY_API_URL": "http://127.0.0.1:8001", "KUBEVIRT_DEMO_ADMIN_TOKEN": "x",
           "KUBEVIRT_SPAWNER_KUBECONFIG": str(tmp_path / "kubeconfig"), "KUBEVIRT_DEMO_EXTRA_CONFIG": "",
           "KUBEVIRT_DEMO_SERVICE_PORT": "8123"}
    c = load(DEMO_CONFIG, env, monkeypatch)
    spawner = KubeVirtSpawner(config=c)
    assert spawner.url_mode == "cluster-ip"
    assert [p["slug"] for p in spawner._profiles()] == ["cpu", "gpu-a100-1", "gpu-a100-2"]


def service_registered(c, port: int | None = None):
    """The workstations service: started by the hub with the hub's own config file, with a role of
    exactly its scopes; users and their servers' tokens may call it."""
    from kubevirt_spawner.service import CONFIG_ENV, SERVICE_SCOPES
    [service] = [s for s in c.JupyterHub.services if s["name"] == "workstations"]
    command = service["command"]
    assert command[command.index("service"):] == ["service", "--ip", command[-3], "--port", command[-1]]
    # the hub's whole config, not the fragment that registers the service
    assert service["environment"][CONFIG_ENV].endswith(("hub-config/jupyterhub_config.py", "demo_config.py"))
    if port:
        assert service["url"] == f"http://127.0.0.1:{port}"
    # The workstations' Lab panels reach it where the proxy does (the guest server extension).
    assert c.KubeVirtSpawner.workstations_url == service["url"] + "/services/workstations/"
    # Activity is what servers report, not traffic through the proxy (an open tab's polling).
    assert c.JupyterHub.last_activity_interval == 0
    [role] = [r for r in c.JupyterHub.load_roles if r["name"] == "workstations-service"]
    assert role["services"] == ["workstations"] and role["scopes"] == SERVICE_SCOPES
    assert "access:services!service=workstations" in c.JupyterHub.extra_user_scopes
    assert c.KubeVirtSpawner.server_token_scopes == ["users:activity!user", "access:servers!server",
                                                     "access:services!service=workstations"]
    return service


def test_both_configs_register_the_workstations_service(monkeypatch, tmp_path):
    c = load(HUB_CONFIG / "jupyterhub_config.py", {"POD_NAMESPACE": "hub-prod", **PUBLIC, "KUBERNETES_SERVICE_HOST": "10.0.0.1",
                                                   "KUBERNETES_SERVICE_PORT": "443", "PGPASSWORD": "db",
                                                   "CONFIGPROXY_AUTH_TOKEN": "proxy"}, monkeypatch)
    env = service_registered(c)["environment"]
    # In the hub's pod, the service needs what the in-cluster client reads, and what this file reads.
    assert env["KUBERNETES_SERVICE_HOST"] == "10.0.0.1" and env["POD_NAMESPACE"] == "hub-prod"
    # and the hub database's password, as Zero-to-JupyterHub gives it (the SSH keys live there);
    # no other secret (jupyterhub/templates/hub/deployment.yaml: PGPASSWORD, MYSQL_PWD)
    assert env["PGPASSWORD"] == "db" and "CONFIGPROXY_AUTH_TOKEN" not in env
    assert c.Workstations.snapshot_limit == 20
    demo_env = {"KUBEVIRT_DEMO_STATE": str(tmp_path), "KUBEVIRT_DEMO_PORT": "8000", "KUBEVIRT_DEMO_HUB_PORT": "8081",
                "CONFIGPROXY_API_URL": "http://127.0.0.1:8001", "KUBEVIRT_DEMO_ADMIN_TOKEN": "secret",
                "KUBEVIRT_DEMO_SERVICE_PORT": "8123",
                "KUBEVIRT_SPAWNER_KUBECONFIG": str(tmp_path / "kubeconfig"), "KUBEVIRT_DEMO_EXTRA_CONFIG": ""}
    env = service_registered(load(DEMO_CONFIG, demo_env, monkeypatch), 8123)["environment"]
    assert "KUBEVIRT_DEMO_ADMIN_TOKEN" not in env and "CONFIGPROXY_AUTH_TOKEN" not in env  # no secrets it needs not


def test_in_a_cluster_the_service_listens_on_the_hub_pods_address(monkeypatch):
    """In the hub's pod the proxy (its own pod) and the workstations (VMs) reach the service through
    the Service `hub`, not the pod's loopback."""
    c = load(HUB_CONFIG / "jupyterhub_config.py", {"POD_NAMESPACE": "hub-prod", **PUBLIC}, monkeypatch)
    [service] = [s for s in c.JupyterHub.services if s["name"] == "workstations"]
    assert service["command"][-4:] == ["--ip", "0.0.0.0", "--port", "10101"]
    assert service["url"] == "http://hub.hub-prod.svc.cluster.local:10101"
    spawner = KubeVirtSpawner(config=c)
    assert spawner.workstations_url == "http://hub.hub-prod.svc.cluster.local:10101/services/workstations/"
    assert spawner.default_url == "/lab"  # a workstation is a JupyterLab machine


def test_both_configs_run_the_standard_idle_culler_and_the_service_knows_its_policy(monkeypatch, tmp_path):
    """jupyterhub-idle-culler as a hub-managed service with the scopes its README lists
    (jupyterhub/jupyterhub-idle-culler README.md, "Permissions"), never deleting users or named
    servers; the workstations service gets the same timeout for the Lab's warning."""
    from kubevirt_spawner.service import CULLER_SCOPES
    prod = load(HUB_CONFIG / "jupyterhub_config.py", {"POD_NAMESPACE": "hub-prod", **PUBLIC}, monkeypatch)
    demo_env = {"KUBEVIRT_DEMO_STATE": str(tmp_path), "KUBEVIRT_DEMO_PORT": "8000", "KUBEVIRT_DEMO_HUB_PORT": "8081",
                "CONFIGPROXY_API_URL": "http://127.0.0.1:8001", "KUBEVIRT_DEMO_SERVICE_PORT": "8123",
                "KUBEVIRT_SPAWNER_KUBECONFIG": str(tmp_path / "kubeconfig"), "KUBEVIRT_DEMO_EXTRA_CONFIG": ""}
    demo = load(DEMO_CONFIG, demo_env, monkeypatch)
    for c in (prod, demo):
        [culler] = [s for s in c.JupyterHub.services if s["name"] == "idle-culler"]
        command = culler["command"]
        assert command[1:3] == ["-m", "jupyterhub_idle_culler"]
        assert "--timeout=3600" in command and "--cull-every=360" in command
        assert "--cull-users=false" in command and "--remove-named-servers=false" in command
        [role] = [r for r in c.JupyterHub.load_roles if r["name"] == "idle-culler"]
        assert role["scopes"] == CULLER_SCOPES and role["services"] == ["idle-culler"]
        assert (c.Workstations.idle_timeout, c.Workstations.idle_cull_every, c.Workstations.idle_warn_before) == \
            (3600, 360, 600)


def test_a_bad_idle_policy_is_refused():
    import pytest
    from traitlets.config import Config

    from kubevirt_spawner.service import register_idle_culler
    for bad in ({"timeout": 5}, {"timeout": 3600, "cull_every": 0}, {"timeout": 3600, "cull_every": 3601},
                {"timeout": 3600, "warn_before": -1}, {"timeout": 600, "warn_before": 600}):
        c = Config()
        with pytest.raises(ValueError):
            register_idle_culler(c, **bad)
        assert "services" not in c.JupyterHub  # nothing half-registered


def test_registering_the_culler_again_replaces_the_idle_policy():
    from traitlets.config import Config

    from kubevirt_spawner.service import register_idle_culler
    c = Config()
    register_idle_culler(c, timeout=3600)
    register_idle_culler(c, timeout=20, cull_every=5, warn_before=10)
    [culler] = [s for s in c.JupyterHub.services if s["name"] == "idle-culler"]
    assert "--timeout=20" in culler["command"] and "--cull-every=5" in culler["command"]
    assert [r["name"] for r in c.JupyterHub.load_roles] == ["idle-culler"]
    assert (c.Workstations.idle_timeout, c.Workstations.idle_warn_before) == (20, 10)


def test_the_default_check_interval_is_never_longer_than_the_timeout():
    """A tenth of the timeout, at least 30 s (jupyterhub-idle-culler's own default is half the timeout,
    jupyterhub_idle_culler/__init__.py), but a
    short timeout is checked at least once per timeout."""
    from traitlets.config import Config

    from kubevirt_spawner.service import register_idle_culler
    for timeout, every in ((3600, 360), (120, 30), (20, 20)):
        c = Config()
        register_idle_culler(c, timeout=timeout, warn_before=10)
        assert c.Workstations.idle_cull_every == every


def test_with_subdomains_a_workstation_is_told_where_the_service_is(monkeypatch):
    """Issue 30, item 1. With subdomain_host JupyterHub gives each service a host of its own
    (jupyterhub/app.py: subdomain_hook(name, domain, kind="service"), by default NAME--service.HUB),
    which the guest cannot work out: the spawner passes the service's public URL, so the Lab
    panel's links reach it. Without subdomains nothing is passed (the path under the hub's base URL)."""
    import types

    from jupyterhub.app import JupyterHub
    from jupyterhub.utils import subdomain_hook_idna
    service = types.SimpleNamespace(host="https://" + subdomain_hook_idna("workstations", "jupyter.example.org",
                                                                             "service"),
                                    prefix="/services/workstations/")
    settings = {"services": {"workstations": service}}
    spawner = KubeVirtSpawner(user=types.SimpleNamespace(name="alice", url="/user/alice/", settings=settings))
    assert spawner._workstations_page() == "https://workstations--service.jupyter.example.org/services/workstations/"
    service.host = ""  # no subdomains
    assert spawner._workstations_page() == ""
    assert "subdomain_hook" in JupyterHub.class_traits()  # (the hook the service's host comes from)
