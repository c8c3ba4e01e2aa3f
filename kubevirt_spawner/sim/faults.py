"""The simulator's own control API under /sim/v1/ (plain JSON, not Kubernetes): faults to
inject and facts to read back."""

from __future__ import annotations

import re
import time

from . import errors
from .server import FaultPicker


class Faults:
    def __init__(self, cluster):
        self.c = cluster
        self.api = FaultPicker()
        self.clone_failures = 0

    def maybe_fail(self, verb: str, resource: str):
        self.api.maybe_fail(verb, resource)

    def take_clone_failure(self) -> bool:
        if self.clone_failures > 0:
            self.clone_failures -= 1
            return True
        return False

    async def handle(self, method: str, path: str, body) -> dict:
        body = body or {}
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
                if code not in (429, 500) or not 0 <= rate <= 1:
                    raise errors.bad_request("rate must be within 0..1 and code 429 or 500")
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
                    compute.users[key] = list(body.get("users") or [])
                elif what == "processes":
                    now = time.time()
                    compute.processes[key] = [{**p, "since": p.get("since", now)} for p in body.get("processes") or []]
                else:
                    compute.gpu_utilization[key] = float(body.get("utilization", 0))
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
