"""The simulator's own control API under /sim/v1/ (plain JSON, not Kubernetes): faults to
inject and facts to read back."""

from __future__ import annotations

import math
import re
import time

from . import errors
from .restores import RESTORE
from .server import FaultPicker


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# A terminal's name under /dev (the tty is a file path in the guest: nothing that leaves /dev).
_TTY = re.compile(r"^(pts/[0-9]+|tty[A-Za-z0-9]*|console)$")
# What a guest's users and processes are made of, field by field: the check, and what to give.
USER_FIELDS = {
    "userName": (lambda v: isinstance(v, str) and v != "", "a name"),
    "domain": (lambda v: isinstance(v, str), "a string"),
    "loginTime": (lambda v: v is None or _number(v), "epoch seconds"),
    "host": (lambda v: v is None or isinstance(v, str), "an address, null for a console login"),
    "tty": (lambda v: v is None or (isinstance(v, str) and bool(_TTY.match(v))), "pts/N, ttyN or console"),
    "idleSeconds": (lambda v: v is None or (_number(v) and v >= 0), "seconds since the last input"),
}
PROCESS_FIELDS = {
    "pid": (lambda v: _whole(v) and v > 0, "a process id"),
    "uid": (_whole, "a user id"),
    "command": (lambda v: isinstance(v, str) and "\n" not in v, "one line"),
    "cpu": (lambda v: _number(v) and v >= 0, "percent of one CPU"),
    "since": (_number, "epoch seconds"),
}


def _records(body: dict, name: str, fields: dict, required: str) -> list[dict]:
    """The list `name` of a request body, each record checked before anything changes (a bad one
    written under a guest's root would fail there, where nobody sees it): a 400 saying what is wrong."""
    records = body.get(name)
    records = [] if records is None else records
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise errors.bad_request(f"{name} must be a list of objects")
    give = ", ".join(f"{k} ({what})" for k, (_, what) in fields.items())
    for n, record in enumerate(records):
        wrong = sorted({k for k, v in record.items() if k not in fields or not fields[k][0](v)}
                       | ({required} - set(record)))
        if wrong:
            raise errors.bad_request(f"{name}[{n}]: {', '.join(wrong)} wrong or missing; give {give}, "
                                     f"{required} at least")
    return records


VALIDATING_WEBHOOKS = {
    "VirtualMachine": ("virtualmachine-validator.kubevirt.io", "virt-api.kubevirt.svc", "/virtualmachines-validate"),
    "VirtualMachineSnapshot": ("virtualmachinesnapshot-validator.snapshot.kubevirt.io", "virt-api.kubevirt.svc",
                               "/virtualmachinesnapshots-validate"),
    "VirtualMachineRestore": ("virtualmachinerestore-validator.snapshot.kubevirt.io", "virt-api.kubevirt.svc",
                              "/virtualmachinerestores-validate"),
    "DataVolume": ("datavolume-validate.cdi.kubevirt.io", "cdi-api.cdi.svc", "/datavolume-validate"),
    "Eviction": ("virt-launcher-eviction-interceptor.kubevirt.io", "virt-api.kubevirt.svc", "/pod-eviction-validate"),
}


class Faults:
    def __init__(self, cluster):
        self.c = cluster
        self.api = FaultPicker()
        self.clone_failures = 0
        self.restore_error: str | None = None  # what every restore reports while it is set
        self.webhooks_down = False  # virt-api and cdi-api unreachable from the API server

    def call_virt_api(self):
        """subresources.kubevirt.io is virt-api's aggregated API: with virt-api down, the
        aggregator answers 503 (kube-aggregator pkg/apiserver/handler_proxy.go)."""
        if self.webhooks_down:
            raise errors.ApiError(503, "ServiceUnavailable", "service unavailable")

    def call_webhooks(self, kind: str):
        """The validating webhooks of KubeVirt and CDI (failurePolicy Fail) for an API request that
        creates or changes `kind`: with their servers down, the API server's own refusal
        (apiserver admission/plugin/webhook validating dispatcher: NewInternalError of
        ErrCallingWebhook). The webhooks' names and paths: KubeVirt's
        pkg/virt-operator/resource/generate/components/webhooks.go, CDI's
        pkg/operator/resources/cluster/apiserver.go."""
        hook = VALIDATING_WEBHOOKS.get(kind)
        if self.webhooks_down and hook:
            name, service, path = hook
            raise errors.internal(f'failed calling webhook "{name}": failed to call webhook: Post '
                                  f'"https://{service}:443{path}?timeout=10s": dial tcp 10.96.0.25:443: connect: '
                                  "connection refused")

    def maybe_fail(self, verb: str, resource: str):
        self.api.maybe_fail(verb, resource)

    def take_clone_failure(self) -> bool:
        if self.clone_failures > 0:
            self.clone_failures -= 1
            return True
        return False

    async def handle(self, method: str, path: str, body) -> dict:
        body = body or {}
        if not isinstance(body, dict):
            raise errors.bad_request("The body must be a JSON object.")
        compute = self.c.compute
        m = re.match(r"^/nodes/([^/]+)/(lose|fence|recover)$", path)
        if m and method == "POST":
            {"lose": compute.node_lost, "fence": compute.node_fenced, "recover": compute.node_recovered}[
                m.group(2)](m.group(1))
            return {"node": m.group(1), "action": m.group(2)}
        if path == "/faults/api":
            if method == "PUT":
                rate = float(body.get("rate", 0))
                code = int(body.get("code", 500))
                if code not in (429, 500, 502) or not 0 <= rate <= 1:
                    raise errors.bad_request("rate must be within 0..1 and code 429, 500 or 502 (a proxy's "
                                             "HTML page)")
                self.api.set(body.get("verb", "*"), body.get("resource", "*"), rate, code)
                return {"rules": self._rules()}
            if method == "DELETE":
                self.api.rules.clear()
                return {"rules": []}
            if method == "GET":
                return {"rules": self._rules()}
        if path == "/watches/cut" and method == "POST":
            n = len(self.c.store.watchers)
            self.c.store.cut_watches()
            return {"cut": n}
        if path == "/faults/restores":
            if method == "PUT":
                message = body.get("error")
                if not isinstance(message, str) or not message.strip():
                    raise errors.bad_request('error must be the message restores report, for example '
                                             '"VolumeSnapshot vs-1 not ready"')
                self.restore_error = message.strip()
            elif method == "DELETE":
                self.restore_error = None
            elif method != "GET":
                raise errors.ApiError(405, "MethodNotAllowed", "GET, PUT or DELETE /sim/v1/faults/restores")
            for restore in self.c.store.list(RESTORE):
                self.c.restore_queue.add((restore["metadata"]["namespace"], restore["metadata"]["name"]))
            return {"error": self.restore_error}
        if path == "/faults/webhooks":
            if method == "PUT":
                if not isinstance(body.get("down"), bool):
                    raise errors.bad_request('down must be true (virt-api and cdi-api unreachable) or false')
                self.webhooks_down = body["down"]
            elif method == "DELETE":
                self.webhooks_down = False
            elif method != "GET":
                raise errors.ApiError(405, "MethodNotAllowed", "GET, PUT or DELETE /sim/v1/faults/webhooks")
            return {"down": self.webhooks_down}
        if path == "/clones/fail-next" and method == "POST":
            self.clone_failures += int(body.get("count", 1))
            return {"pending": self.clone_failures}
        m = re.match(r"^/vmis/([^/]+)/([^/]+)/guest$", path)
        if m:
            return self._guest_behaviour((m.group(1), m.group(2)), method, body)
        m = re.match(r"^/vmis/([^/]+)/([^/]+)/(agent|users|gpu|processes)$", path)
        if m:
            key = (m.group(1), m.group(2))
            what = m.group(3)
            if method in ("PUT", "POST"):
                if what == "agent":
                    compute.agents[key] = bool(body.get("connected", True))
                elif what == "users":
                    compute.users[key] = _records(body, "users", USER_FIELDS, "userName")
                elif what == "processes":
                    processes = _records(body, "processes", PROCESS_FIELDS, "pid")
                    if len({p["pid"] for p in processes}) < len(processes):
                        raise errors.bad_request("Each pid may appear only once in processes.")
                    now = time.time()
                    compute.processes[key] = [{**p, "since": p.get("since", now)} for p in processes]
                else:
                    utilization = body.get("utilization", 0)
                    if not (_number(utilization) and 0 <= utilization <= 100):
                        raise errors.bad_request("utilization must be a percentage from 0 to 100.")
                    compute.gpu_utilization[key] = float(utilization)
                compute.write_guest_facts(key)
                self.c.vmi_queue.add(key)
            return {"agentConnected": compute.agents.get(key, True), "users": compute.users.get(key, []),
                    "gpuUtilization": compute.gpu_utilization.get(key, 0.0),
                    "processes": compute.processes.get(key, [])}
        if path == "/violations" and method == "GET":
            return {"violations": compute.violations}
        if path == "/requests":
            if method == "DELETE":
                self.c.requests.counts.clear()
            return {"requests": self.c.requests.snapshot()}
        if path == "/authorized":
            if method == "DELETE":
                self.c.authorized.clear()
            return {"authorized": [{"user": user, "verb": verb, "group": group, "resource": resource, "count": n}
                                   for (user, verb, group, resource), n in sorted(self.c.authorized.items())]}
        if path == "/guests" and method == "GET":
            return {"guests": [{"namespace": k[0], "name": k[1], "ip": g.ip, "root": g.root, "alive": g.alive,
                                "pid": g.proc.pid if g.proc else None} for k, g in compute.guests.items()]}
        if path == "/timing":
            if method == "PUT":
                for k, v in body.items():
                    if k not in self.c.timing:
                        raise errors.bad_request(f"unknown delay {k!r}; known: {sorted(self.c.timing)}")
                    self.c.timing[k] = float(v)
            return {"timing": self.c.timing, "speed": self.c.speed}
        raise errors.ApiError(404, "NotFound", f"no simulator control endpoint {method} /sim/v1{path}")

    def _guest_behaviour(self, key: tuple[str, str], method: str, body: dict) -> dict:
        """How one guest (by VM name) boots and shuts down: {"agentSeconds": N or null for never,
        "shutdownSeconds": N}, in seconds at speed 1. DELETE goes back to the cluster's timing."""
        behaviour = self.c.compute.guest_behaviour
        if method == "PUT":
            unknown = set(body) - {"agentSeconds", "shutdownSeconds"}
            bad = [k for k, v in body.items() if k in ("agentSeconds", "shutdownSeconds") and not (
                (v is None and k == "agentSeconds") or (isinstance(v, (int, float)) and v >= 0))]
            if unknown or bad:
                raise errors.bad_request("give agentSeconds (a number of seconds, or null for never) and/or "
                                         "shutdownSeconds (a number of seconds)")
            behaviour.setdefault(key, {}).update(body)
            self.c.vmi_queue.add(key)
        elif method == "DELETE":
            behaviour.pop(key, None)
            self.c.vmi_queue.add(key)
        return {"guest": behaviour.get(key, {}), "timing": {"agent": self.c.timing["agent"],
                                                             "shutdown": self.c.timing["shutdown"]}}

    def _rules(self):
        return [{"verb": v, "resource": r, "rate": rate, "code": code}
                for (v, r), (rate, code) in self.api.rules.items()]
