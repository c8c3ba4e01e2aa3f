"""docs/openapi.yaml is the workstations service as its tornado routes serve it (service/web.py):
every route and method the service answers is in the document and every one the document has is
answered, each POST's request body has the fields its handler reads, and every error answer is
the documented `{"error": "<one sentence>"}` with a documented status.

The routes are read from the application make_app() builds: each rule's regular expression,
expanded into its path templates through Python's own parser of regular expressions. Which methods
a template takes is what its handler does with a request: a core (the Workstations the handlers
call) that answers every call with {} shows whether the handler gets to the service's work (a 2xx)
or refuses the path and method itself (404, 405)."""

from __future__ import annotations

import json
import logging
import re
import re._constants as sre_constants
import re._parser as sre_parser
import types
from pathlib import Path

import pytest
import yaml
from jupyterhub.services.auth import HubOAuth, UserNotAllowed
from prometheus_client import CollectorRegistry
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port
from traitlets.config import Config

from kubevirt_spawner import kube as k
from kubevirt_spawner.reasons import Reason
from kubevirt_spawner.service import web
from kubevirt_spawner.workstation import WorkstationError

DOC = yaml.safe_load((Path(__file__).resolve().parents[1] / "docs" / "openapi.yaml").read_text())
PREFIX = "/services/workstations/"
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
# The routes that are pages for a browser, not the REST API: the OAuth login's callback and the
# rescue page (HTML forms).
PAGES = {"oauth_callback", "", "workstation/{}", "workstation/{}/servers/{}"}


# ------------------------------------------------------------------ the routes' path templates
def _is_segment(sub) -> bool:
    """A group matching any run of characters (`[^/]+`, `.*`): a path parameter."""
    items = list(sub)
    return len(items) == 1 and items[0][0] in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT) \
        and items[0][1][1] == sre_constants.MAXREPEAT


def _templates(items) -> list[str]:
    out = [""]
    for op, av in items:
        out = [head + tail for head in out for tail in _alternatives(op, av)]
    return out


def _alternatives(op, av) -> list[str]:
    if op is sre_constants.LITERAL:
        return [chr(av)]
    if op is sre_constants.AT:  # (the $ tornado adds)
        return [""]
    if op is sre_constants.SUBPATTERN:
        group, _, _, sub = av
        return ["{}"] if group is not None and _is_segment(sub) else _templates(sub)
    if op is sre_constants.IN and all(item_op is sre_constants.LITERAL for item_op, _ in av):
        return [chr(char) for _, char in av]  # (one-character alternatives, as the parser keeps them)
    if op is sre_constants.BRANCH:
        return [template for branch in av[1] for template in _templates(branch)]
    if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT) and av[:2] == (0, 1):
        return ["", *_templates(av[2])]
    raise AssertionError(f"a route this test cannot expand: {op} {av}")


def route_templates(app) -> dict[str, type]:
    """Each path the application routes, below the prefix, with its handler ("{}": a parameter);
    a trailing slash is optional everywhere, so it is left out."""
    out: dict[str, type] = {}
    for rule in app.wildcard_router.rules:
        for template in _templates(sre_parser.parse(rule.matcher.regex.pattern)):
            assert (template + "/").startswith(PREFIX), template
            out.setdefault(template[len(PREFIX):].rstrip("/"), rule.target)
    return out


def documented() -> set[tuple[str, str]]:
    """(path template below the prefix, METHOD) of every operation of the document."""
    return {(re.sub(r"\{[^}]+\}", "{}", path).lstrip("/"), method.upper())
            for path, item in DOC["paths"].items() for method in item if method.upper() in METHODS}


def operation(path: str, method: str) -> dict:
    """The document's operation at a template of documented()."""
    for doc_path, item in DOC["paths"].items():
        if re.sub(r"\{[^}]+\}", "{}", doc_path).lstrip("/") == path:
            return item[method.lower()]
    raise KeyError(path)


def _resolve(item: dict) -> dict:
    while "$ref" in item:
        node = DOC
        for part in item["$ref"].lstrip("#/").split("/"):
            node = node[part]
        item = node
    return item


# ------------------------------------------------------------------ the service with a core that answers {}
class Part:
    """Stands in for the core (or its drains, its meter): each call is recorded and answered with {},
    awaitable except for the calls the handlers make without await; or raises `fail` if set."""

    def __init__(self, service, plain: set[str]):
        self._service, self._plain = service, plain

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self._service.calls.append(name)
            if self._service.fail is not None:
                raise self._service.fail
            return {}

        async def acall(*args, **kwargs):
            return call(*args, **kwargs)
        return call if name in self._plain else acall


class Service:
    def __init__(self):
        self.calls: list[str] = []
        self.fail: Exception | None = None
        self.model: dict | None = {"kind": "user", "name": "ann", "admin": True, "scopes": [], "groups": []}
        self.allowed = True
        self.read: set[str] = set()  # the body's fields a handler read
        core = Part(self, {"capacity", "refresh_metrics"})
        vars(core).update(config=Config(), hub=types.SimpleNamespace(token="secret"), log=logging.getLogger("test"),
                          registry=CollectorRegistry(), drains=Part(self, {"node_state"}), meter=Part(self, set()))
        self.app = web.make_app(core, PREFIX)
        self.url = ""

    async def request(self, method: str, path: str, body: bytes | None = None):
        """(status, JSON answer or None) of METHOD path (below the prefix)."""
        self.calls.clear()
        answer = await AsyncHTTPClient().fetch(self.url + PREFIX + path, method=method, raise_error=False,
                                               body=body if body is not None else (b"" if method in (
                                                   "POST", "PUT", "PATCH") else None),
                                               allow_nonstandard_methods=True)
        try:
            data = json.loads(answer.body) if answer.body else None
        except ValueError:
            data = None
        return answer.code, data


class Read(dict):
    """A request body that records which fields its handler reads."""

    def __init__(self, data: dict, read: set[str]):
        super().__init__(data)
        self.read = read

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


@pytest.fixture
async def service(monkeypatch):
    s = Service()
    hub_auth = s.app.settings["hub_auth"]
    monkeypatch.setattr(hub_auth, "get_user", lambda handler, **_: s.model)

    def check_hub_user(handler, model):
        if not s.allowed:
            raise UserNotAllowed(model)
        return model
    monkeypatch.setattr(web.Base, "check_hub_user", check_hub_user)
    body = web.Base.body
    monkeypatch.setattr(web.Base, "body", lambda handler: Read(body(handler), s.read))
    sock, port = bind_unused_port()
    server = HTTPServer(s.app, max_body_size=web.MAX_READ_BYTES)
    server.add_sockets([sock])
    s.url = f"http://127.0.0.1:{port}"
    yield s
    server.stop()
    await server.close_all_connections()
    HubOAuth.clear_instance()


def concrete(template: str) -> str:
    """A path of the template, each parameter a value no route has as a word."""
    parts = template.split("{}")
    return "".join(part + (f"p{i}x" if i < len(parts) - 1 else "") for i, part in enumerate(parts))


# ------------------------------------------------------------------ the tests
def test_the_route_expansion_sees_optional_groups_alternatives_and_parameters():
    """The expansion this test relies on, on routes of web.py's kind."""
    regex = re.compile(PREFIX + r"api/v1/w/([^/]+)(?:/servers/([^/]+))?(?:/(a|b))?/?$")
    assert sorted(t[len(PREFIX):] for t in _templates(sre_parser.parse(regex.pattern))) == sorted([
        "api/v1/w/{}", "api/v1/w/{}/", "api/v1/w/{}/a", "api/v1/w/{}/a/", "api/v1/w/{}/b", "api/v1/w/{}/b/",
        "api/v1/w/{}/servers/{}", "api/v1/w/{}/servers/{}/", "api/v1/w/{}/servers/{}/a", "api/v1/w/{}/servers/{}/a/",
        "api/v1/w/{}/servers/{}/b", "api/v1/w/{}/servers/{}/b/"])


async def test_every_route_and_method_the_service_answers_is_documented_and_back(service):
    routes = route_templates(service.app)
    assert PAGES <= set(routes), sorted(PAGES - set(routes))
    served = set()
    for template in sorted(set(routes) - PAGES):
        for method in METHODS:
            status, _ = await service.request(method, concrete(template), b"{}" if method != "GET" else None)
            if 200 <= status < 300:
                assert service.calls, (method, template)  # it reached the service's work
                served.add((template, method))
    assert served - documented() == set(), "served, not in docs/openapi.yaml"
    assert documented() - served == set(), "in docs/openapi.yaml, not served"


async def test_the_documented_success_statuses_are_what_the_handlers_answer(service):
    for path, method in sorted(documented()):
        status, _ = await service.request(method, concrete(path), b"{}" if method != "GET" else None)
        successes = {code for code in operation(path, method)["responses"] if code.startswith("2")}
        assert str(status) in successes, (method, path, status, successes)


async def test_each_post_body_has_the_fields_its_handler_reads(service):
    for path, method in sorted(documented()):
        op = operation(path, method)
        if method == "GET" or method == "DELETE":
            assert "requestBody" not in op, (method, path)
            continue
        service.read.clear()
        await service.request(method, concrete(path), b"{}")
        schema = _resolve(op["requestBody"]["content"]["application/json"]["schema"])
        assert set(schema.get("properties", {})) == service.read, (method, path)


def test_the_error_shape_is_one_sentence_and_every_error_answer_is_it():
    error = DOC["components"]["schemas"]["Error"]
    assert error == {"type": "object", "required": ["error"], "additionalProperties": False,
                     "properties": {"error": {"type": "string", "description": "One sentence for the user."}}}
    for path, method in documented():
        op = operation(path, method)
        for status, response in op["responses"].items():
            if status[0] in "45":
                schema = _resolve(response)["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/Error"}, (method, path, status)
        # every request meets the login (401, 403); a body may be no JSON object or too large
        assert {"401", "403", "5XX"} <= set(op["responses"]), (method, path)
        if "requestBody" in op:
            assert {"400", "413"} <= set(op["responses"]), (method, path)


def _is_error(data, status: int) -> bool:
    return isinstance(data, dict) and set(data) == {"error"} and isinstance(data["error"], str) \
        and bool(data["error"]) and 400 <= status < 600


async def test_each_documented_error_is_answered_as_documented(service):
    """Each documented status, made to happen: the login refusing (401, 403), a body that is not
    JSON (400) or too large (413), and the service's refusals and the cluster's failures."""
    for path, method in sorted(documented()):
        url = concrete(path)
        body = b"{}" if method != "GET" else None
        for status in operation(path, method)["responses"]:
            service.fail, service.model, service.allowed = None, service.model or {
                "kind": "user", "name": "ann", "admin": True, "scopes": [], "groups": []}, True
            if status[0] not in "45":
                continue
            if status == "401":
                service.model = None
            elif status == "403":
                service.allowed = False
            elif status == "413":
                body = b'{"note": "' + b"x" * (web.MAX_BODY_BYTES + 1) + b'"}'
            elif status == "5XX":
                service.fail = k.KubeError(500, "InternalError", "etcd is down")
            else:
                service.fail = web.ServiceError(int(status), "A sentence that says why.")
            answer, data = await service.request(method, url, body)
            body = b"{}" if method != "GET" else None
            assert _is_error(data, answer), (method, path, status, answer, data)
            if status == "5XX":
                assert 500 <= answer < 600, (method, path, answer)
            else:
                assert answer == int(status), (method, path, status, answer, data)
            if status not in ("401", "403", "413", "5XX"):
                assert data == {"error": "A sentence that says why."}
        if "requestBody" in operation(path, method):
            answer, data = await service.request(method, url, b"not json")
            assert (answer, data) == (400, {"error": "The request body is not JSON."}), (method, path)
        service.fail = WorkstationError("The snapshot did not finish in time.", reason=Reason.TIMEOUT, status_code=504)
        answer, data = await service.request(method, url, body)
        assert (answer, data) == (504, {"error": "The snapshot did not finish in time."}), (method, path, answer)
    service.fail = None


async def test_paths_and_methods_the_service_does_not_have_are_errors_too(service):
    for method, path in (("GET", "api/v1/nothing"), ("POST", "api/v1/workstations/ann/restore/again"),
                         ("GET", "api/v1/workstations/ann/restore"), ("DELETE", "api/v1/workstations/ann"),
                         ("PUT", "api/v1/capacity"), ("POST", "metrics")):
        status, data = await service.request(method, path, b"{}" if method != "GET" else None)
        assert status in (404, 405) and _is_error(data, status), (method, path, status, data)
