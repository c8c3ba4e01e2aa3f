"""Helpers shared by the test suites: an in-process simulator and clients bound to it."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import json
import shlex
import shutil
import subprocess
import tempfile
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import requests
import yaml
from kubernetes import client, config

from kubevirt_spawner.sim import SimulatorThread, write_kubeconfig

FAST = 40.0  # controller speed factor in tests
ADMIN = {"Authorization": "Bearer kubevirt-sim-admin"}  # the admin kubeconfig's credentials, for raw requests
# keyed by address and CA: a later simulator may get a stopped one's port, never its CA (its own state dir)
_sessions: dict[tuple[str, str], requests.Session] = {}


def start_sim(path, **options) -> SimulatorThread:
    options.setdefault("speed", FAST)
    return SimulatorThread(str(path), **options).start()


def api_client(sim) -> client.ApiClient:
    return api_client_for(sim.kubeconfig)


def api_client_for(kubeconfig: str) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return client.ApiClient(cfg)


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last value: {last!r})")


def answers(url: str) -> bool:
    """Whether `url` answers 200 now; a server that is not listening (yet) is a plain no."""
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.RequestException:  # refused, reset or timed out
        return False


def http(sim) -> requests.Session:
    """Raw HTTPS requests to the simulator, as its admin (trusting the cluster's CA)."""
    key = (sim.url, sim.ca_file)
    session = _sessions.get(key)
    if session is None:
        session = _sessions[key] = requests.Session()
        session.trust_env = False  # REQUESTS_CA_BUNDLE would replace the cluster CA
        session.verify = sim.ca_file
        session.headers.update(ADMIN)
    return session


def sim_api(sim, method: str, path: str, body: dict | None = None) -> dict:
    """A call to the simulator's /sim/v1 control API (faults, timing, request counts)."""
    r = http(sim).request(method, f"{sim.url}/sim/v1{path}", json=body, timeout=30)
    assert r.status_code < 400, r.text
    return r.json()


def service_account_kubeconfig(sim, namespace: str, name: str, path) -> str:
    """A kubeconfig that authenticates as ServiceAccount `namespace/name`, with a token from the
    TokenRequest API (the ServiceAccount is created when missing). Its permissions are whatever
    RBAC grants it."""
    core = client.CoreV1Api(api_client(sim))
    try:
        core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    token = core.create_namespaced_service_account_token(
        name, namespace, {"spec": {"expirationSeconds": 24 * 3600}}).status.token
    return write_kubeconfig(str(path), sim.url, sim.ca_file, f"system:serviceaccount:{namespace}:{name}", token,
                            namespace)


HUB_NAMESPACE = "jupyterhub"
HUB_SERVICE_ACCOUNT = "hub"
DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


@functools.cache
def rendered_deploy() -> Path:
    """deploy/'s manifests rendered from deploy/settings.env (deploy/render.sh), once per run."""
    out = Path(tempfile.mkdtemp(prefix="kvs-rendered-"))
    atexit.register(shutil.rmtree, out, True)
    subprocess.run(["bash", str(DEPLOY / "render.sh"), "--out", str(out)], check=True, capture_output=True)
    return out


def hub_rbac_objects(hub_namespace: str = HUB_NAMESPACE) -> list[dict]:
    """The hub's RBAC as deploy/rbac/ ships it (rendered), bound to the hub's ServiceAccount in
    `hub_namespace`."""
    objects = []
    for path in sorted((rendered_deploy() / "rbac").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for subject in doc.get("subjects") or []:
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = hub_namespace
            objects.append(doc)
    return objects


def apply(sim, obj: dict):
    """Create the object, or replace it when it exists (what `kubectl apply` ends in), as the admin."""
    group, _, version = obj["apiVersion"].rpartition("/")
    plural = {"ClusterRole": "clusterroles", "ClusterRoleBinding": "clusterrolebindings", "Role": "roles",
              "RoleBinding": "rolebindings", "Namespace": "namespaces", "ServiceAccount": "serviceaccounts",
              "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
              "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings"}[obj["kind"]]
    base = f"{sim.url}/apis/{group}/{version}" if group else f"{sim.url}/api/{version}"
    ns = obj["metadata"].get("namespace")
    collection = f"{base}/namespaces/{ns}/{plural}" if ns else f"{base}/{plural}"
    r = http(sim).post(collection, json=obj)
    if r.status_code == 409:
        r = http(sim).put(f"{collection}/{obj['metadata']['name']}", json=obj)
    assert r.status_code in (200, 201), r.text


def hub_admission_policy(hub_namespace: str = HUB_NAMESPACE) -> list[dict]:
    """deploy/guardrails/'s ValidatingAdmissionPolicy and its binding (rendered), for the hub's
    ServiceAccount in `hub_namespace`."""
    text = (rendered_deploy() / "guardrails" / "hub-admission-policy.yaml").read_text()
    return list(yaml.safe_load_all(text.replace(f"system:serviceaccount:{HUB_NAMESPACE}:",
                                                f"system:serviceaccount:{hub_namespace}:")))


@contextlib.contextmanager
def site_policy(sim, **settings: str):
    """The hub's admission policy rendered with a site's deploy/settings.env values (`settings`,
    by name) in force for the block, then the default one again: a test whose hub settings a
    site must also list there (a namespace prefix, its labels' prefixes)."""
    out = Path(tempfile.mkdtemp(prefix="kvs-site-"))
    try:
        lines = [line for line in (DEPLOY / "settings.env").read_text().splitlines()
                 if line.partition("=")[0] not in settings]
        lines += [f"{name}={shlex.quote(value)}" for name, value in settings.items()]
        (out / "site.env").write_text("\n".join(lines) + "\n")
        subprocess.run(["bash", str(DEPLOY / "render.sh"), "--out", str(out / "r"), "--settings",
                        str(out / "site.env")], check=True, capture_output=True)
        for obj in yaml.safe_load_all((out / "r" / "guardrails" / "hub-admission-policy.yaml").read_text()):
            apply(sim, obj)
        yield
    finally:
        for obj in hub_admission_policy():
            apply(sim, obj)
        shutil.rmtree(out, ignore_errors=True)


def hub_kubeconfig(sim, path, objects: list[dict] | None = None, hub_namespace: str = HUB_NAMESPACE,
                   policy: bool = True) -> str:
    """The hub's ServiceAccount with the RBAC of deploy/rbac/ (or `objects`) and, unless `policy`
    is False, the admission policy of deploy/guardrails/, which the simulator evaluates on every
    write of the hub as kube-apiserver does: a kubeconfig with its token."""
    apply(sim, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": hub_namespace}})
    for obj in hub_rbac_objects(hub_namespace) if objects is None else objects:
        apply(sim, obj)
    for obj in hub_admission_policy(hub_namespace) if policy else ():
        apply(sim, obj)
    return service_account_kubeconfig(sim, hub_namespace, HUB_SERVICE_ACCOUNT, path)


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs, wherever their sessions are (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # after the command, which is in parentheses and may hold anything: state, ppid, ...
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class KeysService(BaseHTTPRequestHandler):
    """What the guest's keys command asks: GET .../ssh-keys with the server's token."""

    answers: dict = {}

    def do_GET(self):
        status, body = self.answers.get(self.path, (404, {"error": "No such endpoint."}))
        if self.headers.get("Authorization") != "token s3cret":
            status, body = 403, {"error": "This token may not use the workstations service."}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        """Quiet: a test's output is its own, not the stand-in's access log."""


async def tasks_left_running(grace: float = 5.0) -> list[asyncio.Task]:
    """The loop's tasks but this one still running after `grace` seconds (a task just cancelled,
    as a stopped cache's watches are, gets that long to unwind)."""
    mine = asyncio.current_task()
    running = [t for t in asyncio.all_tasks() if t is not mine and not t.done()]
    if running:
        await asyncio.wait(running, timeout=grace)
    return [t for t in running if not t.done()]
