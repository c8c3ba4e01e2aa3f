"""deploy/: every manifest renders from deploy/settings.env, parses and validates: Kubernetes'
own kinds against Kubernetes 1.32's schemas (kubernetes-validate, strict), KubeVirt's and CDI's
against their upstream schemas (../shared/schemas), the few others by the rules of their upstream
CRDs stated here; and the pieces agree with each other and with the hub's config."""

from __future__ import annotations

import copy
import pathlib
import re
import subprocess

import kubernetes_validate
import promql_parser
import pytest
import yaml
from traitlets.config import Config

from kubevirt_spawner.service import SERVICE_NAME
from kubevirt_spawner.sim.schema import SchemaRegistry

REPO = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
RENDER = DEPLOY / "render.sh"
# Helm values for Zero-to-JupyterHub and a merge patch: not Kubernetes objects.
NOT_OBJECTS = ("jupyterhub/values.yaml", "jupyterhub/oidc-example.yaml", "cluster/storageprofile-patch.yaml")
UPSTREAM_SCHEMA_KINDS = ("KubeVirt", "CDI", "DataVolume")


def render(out: pathlib.Path, settings: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    args = ["bash", str(RENDER), "--out", str(out)] + (["--settings", str(settings)] if settings else [])
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("rendered")
    done = render(out)
    assert done.returncode == 0, done.stderr
    return out


def manifests(root: pathlib.Path) -> list[tuple[str, dict]]:
    found = []
    for path in sorted(root.rglob("*.yaml")):
        rel = str(path.relative_to(root))
        if rel in NOT_OBJECTS:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict) and doc, f"{rel} holds an empty or non-object document"
            found.append((rel, doc))
    return found


def test_every_setting_is_filled_in_and_every_file_parses(rendered):
    templates = sorted(str(p.relative_to(DEPLOY)) for d in ("rbac", "host", "cluster", "jupyterhub", "guardrails")
                       for p in (DEPLOY / d).rglob("*.yaml"))
    assert sorted(str(p.relative_to(rendered)) for p in rendered.rglob("*.yaml")) == templates
    for path in rendered.rglob("*.yaml"):
        text = path.read_text()
        assert "${" not in text, f"{path.name} keeps a placeholder"
        list(yaml.safe_load_all(text))
    # the golden image recipe's YAML (cloud-init) parses too
    yaml.safe_load((DEPLOY / "golden-image" / "cloud.cfg").read_text())


def test_core_kinds_validate_against_kubernetes_1_32(rendered):
    checked = set()
    for rel, doc in manifests(rendered):
        try:
            kubernetes_validate.validate(doc, "1.32", strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            continue  # a CRD's kind: the tests below
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{rel}: {doc['kind']} {doc['metadata'].get('name')}: {'.'.join(map(str, err.path))}: "
                        f"{err.message}")
        checked.add(doc["kind"])
    assert {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Namespace", "DaemonSet", "StorageClass",
            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "Ingress"} <= checked


def test_kubevirt_and_cdi_objects_validate_against_the_upstream_schemas(rendered, schemas: SchemaRegistry):
    seen = set()
    for rel, doc in manifests(rendered):
        if doc["kind"] in UPSTREAM_SCHEMA_KINDS:
            schema = schemas.for_kind(doc["kind"])
            assert schema.errors(doc) == [] and schema.unknown_fields(doc) == [], rel
            seen.add(doc["kind"])
    assert seen == set(UPSTREAM_SCHEMA_KINDS)
    # the StorageProfile patch, applied to the profile CDI makes for the class
    patch = yaml.safe_load((rendered / "cluster" / "storageprofile-patch.yaml").read_text())
    profile = {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "StorageProfile",
               "metadata": {"name": "ceph-rbd"}, **patch}
    schema = schemas.for_kind("StorageProfile")
    assert schema.errors(profile) == [] and schema.unknown_fields(profile) == []
    # (the schema leaves cloneStrategy a string; CDI's types.go names its values)
    assert profile["spec"]["cloneStrategy"] in ("copy", "snapshot", "csi-clone")
    # a wrong value is caught (the check can fail)
    broken = {**profile, "spec": {**profile["spec"], "claimPropertySets": [{"accessModes": ["ReadWriteOnce"],
                                                                            "volumeMode": "Blocky"}]}}
    assert schema.errors(broken)


def test_the_other_crds_follow_their_upstream_rules(rendered):
    """VolumeSnapshotClass (kubernetes-csi/external-snapshotter client/config/crd/
    snapshot.storage.k8s.io_volumesnapshotclasses.yaml), HTTPRoute (gateway-api v1),
    PrometheusRule and ServiceMonitor (prometheus-operator monitoring.coreos.com/v1)."""
    kinds = {}
    for _rel, doc in manifests(rendered):
        kinds.setdefault(doc["kind"], []).append(doc)
    for vsc in kinds.pop("VolumeSnapshotClass"):
        assert set(vsc) <= {"apiVersion", "kind", "metadata", "driver", "parameters", "deletionPolicy"}
        assert vsc["driver"] == "rbd.csi.ceph.com" and vsc["deletionPolicy"] in ("Delete", "Retain")
    for route in kinds.pop("HTTPRoute"):
        assert set(route["spec"]) <= {"parentRefs", "hostnames", "rules"}
        for rule in route["spec"]["rules"]:
            assert all(m["path"]["type"] in ("Exact", "PathPrefix", "RegularExpression") for m in rule["matches"])
            assert all(set(b) <= {"name", "namespace", "port", "kind", "group", "weight"} for b in rule["backendRefs"])
    for monitor in kinds.pop("ServiceMonitor"):
        assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
        for endpoint in monitor["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scheme", "authorization"}
            assert re.fullmatch(r"(\d+[smh])+", endpoint["interval"])
    alerts: set[str] = set()
    for rules in kinds.pop("PrometheusRule"):
        for group in rules["spec"]["groups"]:
            assert set(group) <= {"name", "interval", "rules"}
            for rule in group["rules"]:
                assert ("alert" in rule) != ("record" in rule) and rule["expr"].strip()
                promql_parser.parse(rule["expr"])  # a ValueError names what does not parse
                assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations"}
                assert "for" not in rule or re.fullmatch(r"(\d+[smhdwy])+", rule["for"])
                if "alert" in rule:
                    assert rule["labels"]["severity"] in ("info", "warning", "critical")
                    alerts.add(rule["alert"])
                    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    # the design document's disk steps, stuck starts, clones, snapshots and the Ceph pool
    assert {"WorkstationDiskFilling", "WorkstationDiskAlmostFull", "WorkstationDiskFull", "WorkstationStuckStarting",
            "WorkstationDiskCloneNotFinishing", "WorkstationSnapshotsFailing", "CephWorkstationPoolNearFull"} <= alerts
    with pytest.raises(ValueError):
        promql_parser.parse("max by (namespace (x")  # (the parser does refuse)
    # CiliumNetworkPolicy (cilium.io/v2, its CRD's fields): an endpoint selector and egress rules
    for policy in kinds.pop("CiliumNetworkPolicy"):
        assert set(policy["spec"]) <= {"endpointSelector", "ingress", "egress", "description"}
        for rule in policy["spec"]["egress"]:
            assert set(rule) <= {"toEntities", "toEndpoints", "toCIDR", "toCIDRSet", "toPorts", "toFQDNs"}
            assert set(rule.get("toEntities", [])) <= {"kube-apiserver", "cluster", "world", "host", "remote-node",
                                                      "all", "health", "init", "ingress", "unmanaged"}
    # and every other kind is one of Kubernetes' own, which kubernetes-validate knows
    for kind, docs in kinds.items():
        if kind not in UPSTREAM_SCHEMA_KINDS:
            assert kubernetes_validate.validate(docs[0], "1.32", strict=True) == "1.32", kind


def test_render_refuses_bad_settings_and_writes_nothing(tmp_path):
    settings = (DEPLOY / "settings.env").read_text()
    cases = {
        "missing": (re.sub(r"(?m)^CEPH_POOL=.*$", "CEPH_POOL=", settings), "does not set CEPH_POOL"),
        "gpu": (settings.replace('GPU_DEVICES="10DE:20B0=nvidia.com/A100-PCIE-40GB"', 'GPU_DEVICES="A100"'),
                "GPU_DEVICES entry 'A100' is not VENDOR:DEVICE=RESOURCE_NAME"),
        "namespace": (settings.replace("HUB_NAMESPACE=jupyterhub", "HUB_NAMESPACE=Jupyter_Hub"),
                      "HUB_NAMESPACE=Jupyter_Hub is not a DNS label"),
    }
    for name, (text, message) in cases.items():
        file = tmp_path / f"{name}.env"
        file.write_text(text)
        done = render(tmp_path / f"out-{name}", file)
        assert done.returncode == 2 and message in done.stderr, (name, done.stderr)
        assert not (tmp_path / f"out-{name}").exists()
    # a caller's environment does not fill a setting the file lacks
    file = tmp_path / "partial.env"
    file.write_text(re.sub(r"(?m)^STORAGE_CLASS=.*$", "", settings))
    done = subprocess.run(["bash", str(RENDER), "--settings", str(file), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "STORAGE_CLASS": "x"},
                          check=False)
    assert done.returncode == 2 and "does not set STORAGE_CLASS" in done.stderr


def test_a_cluster_without_gpus_and_with_a_numeric_ceph_id(tmp_path, monkeypatch):
    """GPU_DEVICES="" renders no permitted devices and no GPU profile; a Ceph cluster ID of digits
    stays a string (StorageClass parameters are map[string]string)."""
    from kubevirt_spawner.spawner import KubeVirtSpawner
    file = tmp_path / "cpu.env"
    file.write_text(re.sub(r"(?m)^GPU_DEVICES=.*$", 'GPU_DEVICES=""', (DEPLOY / "settings.env").read_text())
                    .replace("CEPH_CLUSTER_ID=b9127830-b0cc-4e34-aa47-9d1a2e9949a8", "CEPH_CLUSTER_ID=1234"))
    done = render(tmp_path / "out", file)
    assert done.returncode == 0, done.stderr
    kv = yaml.safe_load((tmp_path / "out" / "cluster" / "kubevirt-cr.yaml").read_text())
    assert kv["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"] == []
    storage = list(yaml.safe_load_all((tmp_path / "out" / "cluster" / "storage.yaml").read_text()))
    assert [doc["parameters"]["clusterID"] for doc in storage] == ["1234"] * 3
    values = yaml.safe_load((tmp_path / "out" / "jupyterhub" / "values.yaml").read_text())
    spawner = KubeVirtSpawner(config=as_the_chart_runs_it(values, {"POD_NAMESPACE": "jupyterhub"}, monkeypatch))
    assert [p["slug"] for p in spawner._profiles()] == ["cpu-4"]
    assert not any("nvidia" in key for key in spawner.namespace_resource_quota)


def test_settings_reach_the_manifests(tmp_path):
    settings = (DEPLOY / "settings.env").read_text()
    file = tmp_path / "site.env"
    file.write_text(settings.replace('GPU_DEVICES="10DE:20B0=nvidia.com/A100-PCIE-40GB"',
                                     'GPU_DEVICES="10DE:20B0=nvidia.com/A100-PCIE-40GB 10DE:2236=nvidia.com/A10"')
                    .replace("HUB_NAMESPACE=jupyterhub", "HUB_NAMESPACE=research-hub"))
    assert render(tmp_path / "out", file).returncode == 0
    kv = yaml.safe_load((tmp_path / "out" / "cluster" / "kubevirt-cr.yaml").read_text())
    assert kv["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"] == [
        {"pciVendorSelector": "10DE:20B0", "resourceName": "nvidia.com/A100-PCIE-40GB"},
        {"pciVendorSelector": "10DE:2236", "resourceName": "nvidia.com/A10"}]
    assert kv["spec"]["configuration"]["developerConfiguration"]["featureGates"] == ["HostDevices", "Snapshot"]
    binding = next(doc for doc in yaml.safe_load_all((tmp_path / "out" / "rbac" / "hub-clusterrole.yaml").read_text())
                   if doc["kind"] == "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "hub", "namespace": "research-hub"}]


FRAGMENT = REPO / "hub-config" / "kubevirt_spawner_config.py"


def as_the_chart_runs_it(values: dict, env: dict, monkeypatch) -> Config:
    """The hub's config as Zero-to-JupyterHub's hub pod builds it (jupyterhub/files/hub/
    jupyterhub_config.py): the chart's own settings and services first, hub.extraEnv in the
    environment, then each hub.extraConfig snippet exec'd in that file's namespace, with the
    image's copy of the fragment where the Dockerfile puts it."""
    for name, value in {**env, **values["hub"]["extraEnv"]}.items():
        monkeypatch.setenv(name, value)
    c = Config()
    c.JupyterHub.spawner_class = "kubespawner.KubeSpawner"
    c.JupyterHub.hub_connect_url = "http://hub:8081"
    c.JupyterHub.db_url = "postgresql://hub@db.example/jupyterhub"
    # hub.services and hub.loadRoles, a site's own and the values', as the chart lists them
    c.JupyterHub.services = [{"name": "grafana", "url": "http://grafana:3000", "api_token": "t"}] + [
        {**service, "name": name, "api_token": f"generated-{name}"}
        for name, service in values["hub"].get("services", {}).items()]
    c.JupyterHub.load_roles = [{"name": "user", "scopes": ["self", "read:metrics"]}] + [
        {**role, "name": name} for name, role in values["hub"].get("loadRoles", {}).items()]
    for section, settings in values["hub"].get("config", {}).items():  # hub.config, before extraConfig
        c[section].update(settings)
    dockerfile = (DEPLOY / "jupyterhub" / "hub-image" / "Dockerfile").read_text()
    copied = re.search(r"^COPY hub-config/kubevirt_spawner_config.py (\S+)$", dockerfile, re.M).group(1)
    namespace = {"c": c, "open": lambda path, *a: open(FRAGMENT if path == copied else path, *a)}
    for _, snippet in sorted(values["hub"]["extraConfig"].items()):
        exec(snippet, namespace)
    return c


def test_the_config_adds_to_the_charts_services_and_roles(rendered, monkeypatch):
    """What the site configured through the chart (hub.services, hub.loadRoles, hub.db) stays;
    the workstations service and the idle culler are added; guests in other namespaces reach the
    hub by its full DNS name (the chart's hub_connect_url is the short `hub`)."""
    values = yaml.safe_load((rendered / "jupyterhub" / "values.yaml").read_text())
    c = as_the_chart_runs_it(values, {"POD_NAMESPACE": "jupyterhub"}, monkeypatch)
    # users' pages on subdomains of the public host (issue 30, item 1): the chart starts the proxy
    # with --host-routing for it (jupyterhub/templates/proxy/deployment.yaml, 4.4.0)
    assert c.JupyterHub.subdomain_host == "https://jupyter.example.com"
    assert c.JupyterHub.cookie_host_prefix_enabled is True
    assert [s["name"] for s in c.JupyterHub.services] == ["grafana", "prometheus", SERVICE_NAME, "idle-culler"]
    assert [r["name"] for r in c.JupyterHub.load_roles] == ["user", "workstations-metrics", "workstations-service",
                                                            "idle-culler"]
    # the site's own `user` role (which makes JupyterHub ignore extra_user_scopes) lets users reach
    # the service too
    [user_role] = [r for r in c.JupyterHub.load_roles if r["name"] == "user"]
    assert user_role["scopes"] == ["self", "read:metrics", f"access:services!service={SERVICE_NAME}"]
    # Prometheus' token reads the metrics, as the ServiceMonitor sends it, and can do nothing else
    [metrics] = [r for r in c.JupyterHub.load_roles if r["name"] == "workstations-metrics"]
    assert metrics["scopes"] == ["read:metrics", f"access:services!service={SERVICE_NAME}"]
    assert metrics["services"] == ["prometheus"]
    [monitor] = yaml.safe_load_all((rendered / "guardrails" / "servicemonitor.yaml").read_text())
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "hub",
                                                                            "key": "hub.services.prometheus.apiToken"}}
    assert endpoint["port"] == values["hub"]["service"]["extraPorts"][0]["name"]
    assert endpoint["path"] == f"/services/{SERVICE_NAME}/metrics"
    assert c.JupyterHub.db_url == "postgresql://hub@db.example/jupyterhub"
    assert c.JupyterHub.spawner_class == "kubevirt"
    assert c.JupyterHub.hub_connect_url == "http://hub.jupyterhub.svc.cluster.local:8081"


# What Zero-to-JupyterHub 4.4's jupyterhub/files/hub/jupyterhub_config.py does, in its order, for a
# test: the chart's settings, then each hub.config section (c[section].update), then each
# hub.extraConfig snippet exec'd in key order, the image's copy of the fragment being the repo's.
CHART_CONFIG = """
import json, os
values = json.load(open(os.environ["TEST_CHART_VALUES"]))
c.JupyterHub.spawner_class = "kubespawner.KubeSpawner"
c.JupyterHub.hub_connect_url = "http://hub:8081"
c.JupyterHub.services = [{**service, "name": name} for name, service in values["hub"].get("services", {}).items()]
for section, cfg in values["hub"].get("config", {}).items():
    c[section].update(cfg)
for key, config_py in sorted(values["hub"]["extraConfig"].items()):
    exec(config_py.replace(os.environ["TEST_IMAGE_FRAGMENT"], os.environ["TEST_REPO_FRAGMENT"]))
"""


def test_the_service_loads_the_hubs_whole_config_in_the_charts_order(rendered, tmp_path, monkeypatch):
    """A site's settings in the chart's hub.config.KubeVirtSpawner (which the chart applies before
    every hub.extraConfig snippet: they win over the project's defaults all the same), and in a
    hub.extraConfig snippet after the project's (here one that names another golden image), reach
    the spawner; the
    workstations service loads the file JupyterHub was started with (the chart's
    jupyterhub_config.py), in the hub's environment, and so restores and resets with the same
    golden image, names and settings as the spawner."""
    import json

    from jupyterhub.app import JupyterHub

    from kubevirt_spawner.service import CONFIG_ENV
    from kubevirt_spawner.service.web import load_hub_config
    values = yaml.safe_load((rendered / "jupyterhub" / "values.yaml").read_text())
    values["hub"]["config"].update({"KubeVirtSpawner": {"vm_name_template": "{user_server}-machine",
                                                        "root_disk_size": "80Gi"},  # (the project's default: 150Gi)
                                    "Workstations": {"snapshot_limit": 5}})
    values["hub"]["extraConfig"]["50-site"] = 'c.KubeVirtSpawner.golden_image = "site-images/golden-2027"\n'
    (tmp_path / "values.json").write_text(json.dumps(values))
    chart = tmp_path / "jupyterhub_config.py"
    chart.write_text(CHART_CONFIG)
    dockerfile = (DEPLOY / "jupyterhub" / "hub-image" / "Dockerfile").read_text()
    copied = re.search(r"^COPY hub-config/kubevirt_spawner_config.py (\S+)$", dockerfile, re.M).group(1)
    for name, value in {"TEST_CHART_VALUES": str(tmp_path / "values.json"), "TEST_IMAGE_FRAGMENT": copied,
                        "TEST_REPO_FRAGMENT": str(FRAGMENT), "POD_NAMESPACE": "jupyterhub",
                        **values["hub"]["extraEnv"]}.items():
        monkeypatch.setenv(name, value)
    hub = JupyterHub.instance(config_file=str(chart))
    try:
        hub.load_config_file(str(chart))
        seen_by_hub = hub.config
    finally:
        JupyterHub.clear_instance()
    assert seen_by_hub.KubeVirtSpawner.golden_image == "site-images/golden-2027"
    assert seen_by_hub.KubeVirtSpawner.vm_name_template == "{user_server}-machine"
    # hub.config runs before the project's snippet, and still wins over its defaults
    assert seen_by_hub.KubeVirtSpawner.root_disk_size == "80Gi" and seen_by_hub.Workstations.snapshot_limit == 5
    [service] = [s for s in seen_by_hub.JupyterHub.services if s["name"] == SERVICE_NAME]
    assert service["environment"][CONFIG_ENV] == str(chart)
    # the service's process: only the environment the hub gives it (no JupyterHub loading a config)
    for name in list(__import__("os").environ):
        monkeypatch.delenv(name)
    for name, value in service["environment"].items():
        monkeypatch.setenv(name, value)
    seen_by_service = load_hub_config(service["environment"][CONFIG_ENV])
    assert seen_by_service.KubeVirtSpawner == seen_by_hub.KubeVirtSpawner
    assert seen_by_service.Workstations == seen_by_hub.Workstations


def test_the_production_quota_holds_every_workstation_a_user_may_have_while_it_clones(rendered, monkeypatch):
    """hub.namedServerLimitPerUser workstations of the largest profile at once, each with its two
    disks and CDI's temporary copy of its system disk (the clone populator's prime PVC)."""
    from kubevirt_spawner.quantity import parse_quantity
    from kubevirt_spawner.spawner import KubeVirtSpawner
    values = yaml.safe_load((rendered / "jupyterhub" / "values.yaml").read_text())
    c = as_the_chart_runs_it(values, {"POD_NAMESPACE": "jupyterhub"}, monkeypatch)
    spawner = KubeVirtSpawner(config=c)
    per_workstation = max(2 * parse_quantity(spec.root_disk_size) + parse_quantity(spec.workspace_disk_size or 0)
                          for spec in map(spawner._machine_spec, spawner._profiles()))
    servers = values["hub"]["namedServerLimitPerUser"]
    quota = spawner.namespace_resource_quota
    assert parse_quantity(quota["requests.storage"]) >= servers * per_workstation
    assert int(quota["persistentvolumeclaims"]) >= servers * 3


def test_settings_reach_the_hub(tmp_path, monkeypatch):
    """deploy/settings.env's namespace prefix, node labels and GPU models reach the spawner through
    the values' hub.extraEnv: the same labels label-nodes.sh sets, a profile and quota per GPU."""
    from kubevirt_spawner.spawner import KubeVirtSpawner
    file = tmp_path / "settings.env"
    file.write_text((DEPLOY / "settings.env").read_text()
                    .replace("USER_NAMESPACE_PREFIX=notebook-", "USER_NAMESPACE_PREFIX=ws-")
                    .replace("KUBEVIRT_NODE_LABEL=workload.example.com/kubevirt", "KUBEVIRT_NODE_LABEL=pool.acme.io/vm")
                    .replace("ACCELERATOR_LABEL=accelerator.example.com/mode", "ACCELERATOR_LABEL=gpu.acme.io/mode")
                    .replace('GPU_DEVICES="10DE:20B0=nvidia.com/A100-PCIE-40GB"',
                             'GPU_DEVICES="10DE:20B0=nvidia.com/A100-PCIE-40GB 10DE:2236=nvidia.com/A10"')
                    .replace("STORAGE_CLASS=ceph-rbd", "STORAGE_CLASS=rbd-fast")
                    .replace("CLUSTER_DOMAIN=cluster.local", "CLUSTER_DOMAIN=corp.example"))
    assert render(tmp_path / "out", file).returncode == 0
    values = yaml.safe_load((tmp_path / "out" / "jupyterhub" / "values.yaml").read_text())
    c = as_the_chart_runs_it(values, {"POD_NAMESPACE": "research-hub"}, monkeypatch)
    spawner = KubeVirtSpawner(config=c)
    assert spawner.namespace_template == "ws-{user}" and spawner.storage_class == "rbd-fast"
    assert c.JupyterHub.hub_connect_url == "http://hub.research-hub.svc.corp.example:8081"
    profiles = {p["slug"]: p["kubevirt_override"] for p in spawner._profiles()}
    assert list(profiles) == ["cpu-4", "gpu-a100-pcie-40gb-1", "gpu-a10-1"]
    assert profiles["cpu-4"]["node_selector"] == {"pool.acme.io/vm": "true"}
    assert profiles["gpu-a10-1"]["node_selector"] == {"pool.acme.io/vm": "true", "gpu.acme.io/mode": "vfio"}
    assert profiles["gpu-a10-1"]["gpus"] == {"nvidia.com/A10": 1}
    assert profiles["gpu-a10-1"]["tolerations"] == [{"key": "pool.acme.io/vm", "operator": "Equal", "value": "true",
                                                      "effect": "NoSchedule"}]
    assert spawner.namespace_resource_quota["requests.nvidia.com/A10"] == "1"
    label_nodes = (DEPLOY / "host" / "label-nodes.sh").read_text()
    assert '"$NODE_LABEL=true:NoSchedule"' in label_nodes and '"$MODE_LABEL=vfio"' in label_nodes


@pytest.mark.parametrize("firmware", ["bios", "efi"])
def test_the_vms_firmware_is_the_one_the_golden_image_is_built_for(tmp_path, monkeypatch, firmware):
    """One setting, GOLDEN_IMAGE_FIRMWARE, says what the image's bootloader is built for: the golden
    DataVolume records it and every VM the hub makes boots with it, so spec and image agree. A
    firmware the image is not built for does not boot (tests/e2e/test_golden_boot.py)."""
    from kubevirt_spawner import manifests as m
    from kubevirt_spawner.names import identity
    from kubevirt_spawner.spawner import KubeVirtSpawner
    file = tmp_path / "settings.env"
    file.write_text((DEPLOY / "settings.env").read_text().replace("GOLDEN_IMAGE_FIRMWARE=bios",
                                                                  f"GOLDEN_IMAGE_FIRMWARE={firmware}"))
    assert render(tmp_path / "out", file).returncode == 0
    golden = next(d for d in yaml.safe_load_all((tmp_path / "out" / "cluster" / "golden-image.yaml").read_text())
                  if d["kind"] == "DataVolume")
    assert golden["metadata"]["annotations"]["kubevirt-spawner.io/firmware"] == firmware
    values = yaml.safe_load((tmp_path / "out" / "jupyterhub" / "values.yaml").read_text())
    spawner = KubeVirtSpawner(config=as_the_chart_runs_it(values, {"POD_NAMESPACE": "hub"}, monkeypatch))
    spec = spawner._machine_spec(spawner._profiles()[0])
    vm = m.virtual_machine(identity("alice"), spec)
    assert list(vm["spec"]["template"]["spec"]["domain"]["firmware"]["bootloader"]) == [firmware]


def test_a_firmware_no_image_is_built_for_is_refused(tmp_path):
    file = tmp_path / "settings.env"
    file.write_text((DEPLOY / "settings.env").read_text().replace("GOLDEN_IMAGE_FIRMWARE=bios",
                                                                  "GOLDEN_IMAGE_FIRMWARE=uefi"))
    done = render(tmp_path / "out", file)
    assert done.returncode == 2 and "GOLDEN_IMAGE_FIRMWARE=uefi is bios or efi" in done.stderr


def load_hub_config(monkeypatch) -> Config:
    """The production config as the hub image loads it (hub-config/kubevirt_spawner_config.py)."""
    from kubevirt_spawner.service.web import load_hub_config
    monkeypatch.setenv("POD_NAMESPACE", "jupyterhub")
    monkeypatch.setenv("SUBDOMAIN_HOST", "https://jupyter.example.com")  # (the chart's hub.config sets it)
    return load_hub_config(str(FRAGMENT))


def test_the_hub_image_and_the_values_agree_with_the_hub_config(rendered, monkeypatch):
    values = yaml.safe_load((rendered / "jupyterhub" / "values.yaml").read_text())
    dockerfile = (DEPLOY / "jupyterhub" / "hub-image" / "Dockerfile").read_text()
    # the chart runs the config file where the image puts it
    copied = re.search(r"^COPY hub-config/kubevirt_spawner_config.py (\S+)$", dockerfile, re.M).group(1)
    assert f'path = "{copied}"' in values["hub"]["extraConfig"]["00-kubevirt-spawner"]
    for source in re.findall(r"^COPY (\S+) ", dockerfile, re.M):
        assert (REPO / source).exists() or source.endswith("wheels/"), source
    # JupyterHub 6, this package's version, a culler this package supports
    pins = dict(line.split("==") for line in (DEPLOY / "jupyterhub" / "hub-image" / "requirements.txt")
                .read_text().splitlines() if "==" in line)
    import jupyterhub_idle_culler

    import kubevirt_spawner
    assert pins["jupyterhub"].startswith("6.") and pins["kubevirt-spawner"] == kubevirt_spawner.__version__
    assert pins["jupyterhub-idle-culler"].split(".")[0] == jupyterhub_idle_culler.__version__.split(".")[0]
    # the service's port is on the hub's Service and open in its NetworkPolicy to the label the
    # workstations carry; the chart's own culler is off (the config runs the one that warns)
    c = load_hub_config(monkeypatch)
    service = next(s for s in c.JupyterHub.services if s["name"] == SERVICE_NAME)
    port = int(service["url"].rsplit(":", 1)[1])
    assert [p["port"] for p in values["hub"]["service"]["extraPorts"]] == [port]
    label = dict(c.KubeVirtSpawner.extra_labels)
    assert label == {"hub.jupyter.org/network-access-hub": "true"}
    policy = values["hub"]["networkPolicy"]
    assert policy["interNamespaceAccessLabels"] == "accept"
    assert policy["ingress"] == [{"ports": [{"port": port, "protocol": "TCP"}],
                                  "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": label}}]}]
    assert values["cull"]["enabled"] is False
    assert values["hub"]["labels"].items() >= label.items()  # the hub checks the service's health there
    assert values["rbac"]["create"] is False  # the chart's Role (pods, Secrets) is KubeSpawner's
    # a user's namespace admits the chart's hub and proxy pods of the hub's namespace only
    (peer,) = c.KubeVirtSpawner.network_policy_ingress_from
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "jupyterhub"}}
    assert peer["podSelector"]["matchExpressions"] == [{"key": "component", "operator": "In",
                                                        "values": ["hub", "proxy"]}]
    assert any(s["name"] == "idle-culler" or "idle" in s["name"] for s in c.JupyterHub.services)


# ------------------------------------------------------------------ network paths, by selector
# Zero-to-JupyterHub 4.4's policies as its templates render them (jupyterhub/templates/hub/netpol.yaml,
# proxy/netpol.yaml, _helpers-netpol.tpl renderEgressRules), its pods' labels (hub/deployment.yaml,
# proxy/deployment.yaml, the legacy matchLabels app/component/release of _helpers.tpl) and defaults
# (values.yaml: every egressAllowRules flag on for the hub and the proxy, interNamespaceAccessLabels
# ignore). A peer given as ipBlock reaches no pod here: Cilium, and CNIs like it, apply ipBlock to
# cluster-external peers only, so a path the product needs must be allowed by a selector.
PRIVATE_IPS = [{"ipBlock": {"cidr": cidr}} for cidr in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")]


def _allow_rules() -> list[dict]:
    return [{"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
             "to": [{"ipBlock": {"cidr": "169.254.169.254/32"}},
                    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}},
                    *PRIVATE_IPS]},
            {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                                                                 "169.254.169.254/32"]}}]},
            {"to": PRIVATE_IPS}, {"to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}]}]


def _labelled_from(label: str, accept: bool) -> list[dict]:
    peer = {"podSelector": {"matchLabels": {label: "true"}}}
    if not accept:
        return [peer]
    return [{**peer, "namespaceSelector": {"matchLabels": {}}}, {"namespaceSelector": {"matchLabels": {label: "true"}}}]


def chart_policies(values: dict, release: str) -> dict[str, dict]:
    """The hub's and the proxy's NetworkPolicy specs, and their pods' labels and named ports."""
    def legacy(component):
        return {"app": "jupyterhub", "component": component, "release": release}
    hub_np, chp_np = values["hub"].get("networkPolicy", {}), values["proxy"].get("chp", {}).get("networkPolicy", {})
    hub = {"labels": {**legacy("hub"), "hub.jupyter.org/network-access-proxy-api": "true",
                      "hub.jupyter.org/network-access-proxy-http": "true",
                      "hub.jupyter.org/network-access-singleuser": "true", **values["hub"].get("labels", {})},
           "ports": {"http": 8081},
           "ingress": [{"ports": [{"port": "http"}],
                        "from": _labelled_from("hub.jupyter.org/network-access-hub",
                                               hub_np.get("interNamespaceAccessLabels") == "accept")},
                       *hub_np.get("ingress", [])],
           "egress": [{"to": [{"podSelector": {"matchLabels": legacy("proxy")}}], "ports": [{"port": 8001}]},
                      {"to": [{"podSelector": {"matchLabels": legacy("singleuser-server")}}], "ports": [{"port": 8888}]},
                      *_allow_rules(), *hub_np.get("egress", [])]}
    accept = chp_np.get("interNamespaceAccessLabels") == "accept"
    proxy = {"labels": {**legacy("proxy"), "hub.jupyter.org/network-access-hub": "true",
                        "hub.jupyter.org/network-access-singleuser": "true"},
             "ports": {"http": 8000, "api": 8001},
             "ingress": [{"ports": [{"port": "http"}], "from": _labelled_from("hub.jupyter.org/network-access-proxy-http",
                                                                               accept)},
                         {"ports": [{"port": "api"}], "from": _labelled_from("hub.jupyter.org/network-access-proxy-api",
                                                                              accept)},
                         *chp_np.get("ingress", [])],
             "egress": [{"to": [{"podSelector": {"matchLabels": legacy("hub")}}], "ports": [{"port": 8081}]},
                        {"to": [{"podSelector": {"matchLabels": legacy("singleuser-server")}}],
                         "ports": [{"port": 8888}]},
                        *_allow_rules(), *chp_np.get("egress", [])]}
    return {"hub": hub, "proxy": proxy}


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        has, value = e["key"] in labels, labels.get(e["key"])
        if not {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
                "Exists": has, "DoesNotExist": not has}[e["operator"]]:
            return False
    return True


def _peer_has(peer: dict, policy_namespace: str, pod: dict) -> bool:
    if "ipBlock" in peer:
        return False  # never a pod, on Cilium
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], pod["namespace_labels"]):
            return False
    elif pod["namespace"] != policy_namespace:
        return False
    return "podSelector" not in peer or _selects(peer["podSelector"], pod["labels"])


def _port_in(rule: dict, port: int, named: dict) -> bool:
    return not rule.get("ports") or any(p["port"] == port or named.get(p["port"]) == port for p in rule["ports"])


def allowed(rules: list[dict], key: str, policy_namespace: str, peer_pod: dict, port: int, named: dict) -> bool:
    return any(_port_in(rule, port, named) and any(_peer_has(p, policy_namespace, peer_pod) for p in rule.get(key, []))
               for rule in rules)


def test_every_path_the_product_needs_is_allowed_by_selector(rendered, monkeypatch):
    """hub -> workstation:8888 (its wait for the server), proxy -> workstation:8888 (users' traffic),
    proxy -> the workstations service in the hub's pod (10101), workstation -> hub API (8081) and
    service (10101): each allowed by the egress policy of its source and the ingress policy of its
    target (the chart's, and the per-user namespace policy the spawner makes), by pod and
    namespace selectors. The chart's policies alone reach the workstations only through ipBlock:
    without the values' egress rules these paths are refused. The workstation is KubeVirt's
    virt-launcher pod (label kubevirt.io: virt-launcher, pkg/virt-controller/services/template.go)
    with the VM template's labels."""
    from kubevirt_spawner import manifests as m
    from kubevirt_spawner import names
    from kubevirt_spawner.service.web import load_hub_config
    from kubevirt_spawner.spawner import KubeVirtSpawner
    values = yaml.safe_load((rendered / "jupyterhub" / "values.yaml").read_text())
    release, hub_ns, user_ns = "jupyterhub", "jupyterhub", "notebook-alice"
    monkeypatch.setenv("POD_NAMESPACE", hub_ns)
    monkeypatch.setenv("SUBDOMAIN_HOST", "https://jupyter.example.com")
    spawner = KubeVirtSpawner(config=load_hub_config(str(FRAGMENT)))
    ident = names.identity("alice")
    vm = m.virtual_machine(ident, m.MachineSpec(extra_labels=spawner.extra_labels))
    user_policy = m.network_policy(ident, m.MachineSpec().ports, spawner.network_policy_ingress_from)["spec"]
    assert _selects(user_policy["podSelector"], vm["spec"]["template"]["metadata"]["labels"])

    def pods(policies):
        ns_labels = {hub_ns: {"kubernetes.io/metadata.name": hub_ns},
                     user_ns: {"kubernetes.io/metadata.name": user_ns, **m.namespace(ident)["metadata"]["labels"]}}
        out = {name: {"namespace": hub_ns, "namespace_labels": ns_labels[hub_ns], "labels": p["labels"]}
               for name, p in policies.items()}
        out["workstation"] = {"namespace": user_ns, "namespace_labels": ns_labels[user_ns],
                              "labels": {**vm["spec"]["template"]["metadata"]["labels"], "kubevirt.io": "virt-launcher"}}
        return out

    def path(policies, source, target, port) -> bool:
        pod = pods(policies)
        out = allowed(policies[source]["egress"], "to", hub_ns, pod[target], port,
                      policies.get(target, {}).get("ports", {})) if source in policies else True
        if target == "workstation":
            into = allowed(user_policy["ingress"], "from", user_ns, pod[source], port, {})
        else:
            into = allowed(policies[target]["ingress"], "from", hub_ns, pod[source], port, policies[target]["ports"])
        return out and into

    needed = [("hub", "workstation", 8888), ("proxy", "workstation", 8888), ("proxy", "hub", 10101),
              ("workstation", "hub", 8081), ("workstation", "hub", 10101), ("proxy", "hub", 8081),
              ("hub", "proxy", 8001)]
    policies = chart_policies(values, release)
    assert [p for p in needed if not path(policies, *p)] == []
    # workstations do not reach each other, nor the proxy's API
    assert not path(policies, "workstation", "workstation", 8888) and not path(policies, "workstation", "proxy", 8001)
    # the chart alone: only ipBlock towards the users' namespaces and the hub's 10101
    bare = copy.deepcopy(values)
    del bare["hub"]["networkPolicy"]["egress"], bare["proxy"]["chp"]["networkPolicy"]["egress"]
    refused = [p for p in needed if not path(chart_policies(bare, release), *p)]
    assert refused == [("hub", "workstation", 8888), ("proxy", "workstation", 8888), ("proxy", "hub", 10101)]


def test_the_cilium_example_lets_the_hub_reach_the_api_server(rendered):
    """On Cilium the API server is the entity kube-apiserver, which the chart's ipBlock rules never
    match (zero-to-jupyterhub-k8s#3202): the example allows the hub's pod, by its chart labels, to
    reach it on the API ports."""
    [policy] = yaml.safe_load_all((rendered / "jupyterhub" / "cilium-hub-apiserver-example.yaml").read_text())
    values = yaml.safe_load((rendered / "jupyterhub" / "values.yaml").read_text())
    assert policy["apiVersion"] == "cilium.io/v2" and policy["kind"] == "CiliumNetworkPolicy"
    hub_labels = chart_policies(values, "jupyterhub")["hub"]["labels"]
    assert _selects(policy["spec"]["endpointSelector"], hub_labels)
    [rule] = policy["spec"]["egress"]
    assert rule["toEntities"] == ["kube-apiserver"]
    assert {p["port"] for p in rule["toPorts"][0]["ports"]} == {"443", "6443"}
