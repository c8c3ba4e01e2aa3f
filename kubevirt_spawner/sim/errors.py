"""Kubernetes `Status` errors, as the API server and KubeVirt's virt-api send them."""

from __future__ import annotations


class ApiError(Exception):
    """An error answered as a `Status` object (or as plain text when `plain` is set)."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None,
                 plain: bool = False, headers: dict | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.plain = plain
        self.headers = headers or {}

    def status(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


def _details(rt, name: str) -> dict:
    d = {"name": name, "kind": rt.plural}
    if rt.group:
        d["group"] = rt.group
    return d


def not_found(rt, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.group_resource} "{name}" not found', _details(rt, name))


def already_exists(rt, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{rt.group_resource} "{name}" already exists', _details(rt, name))


def conflict(rt, name: str, why: str) -> ApiError:
    # Upstream names the resource by its singular in subresource conflicts
    # ("virtualmachine.kubevirt.io") and by its plural in storage conflicts.
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rt.group_resource} "{name}": {why}',
                    _details(rt, name))


def subresource_conflict(rt, name: str, why: str) -> ApiError:
    resource = f"{rt.singular}.{rt.group}" if rt.group else rt.singular
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}": {why}',
                    {"name": name, "group": rt.group, "kind": rt.singular})


def stale(rt, name: str) -> ApiError:
    return conflict(rt, name, "the object has been modified; please apply your changes to the latest "
                              "version and try again")


def invalid(rt, name: str, causes: list[dict]) -> ApiError:
    """422 Invalid; each cause is {"field", "message", "reason"} as upstream sends them."""
    summary = ", ".join(f'{c["field"]}: {c["message"]}' if c.get("field") else c["message"] for c in causes)
    details = _details(rt, name)
    details["kind"] = rt.kind
    details["causes"] = [{"reason": c.get("reason", "FieldValueInvalid"), "message": c["message"],
                          "field": c.get("field", "")} for c in causes]
    return ApiError(422, "Invalid", f'{rt.qualified_kind} "{name}" is invalid: {summary}', details)


def forbidden(rt, name: str, why: str) -> ApiError:
    return ApiError(403, "Forbidden", f'{rt.group_resource} "{name}" is forbidden: {why}', _details(rt, name))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def internal(message: str) -> ApiError:
    return ApiError(500, "InternalError", f"Internal error occurred: {message}",
                    {"causes": [{"message": message}]})


def too_many_requests(message: str = "Too many requests, please try again later.") -> ApiError:
    return ApiError(429, "TooManyRequests", message, {"retryAfterSeconds": 1}, headers={"Retry-After": "1"})


def proxy_page(code: int, title: str) -> ApiError:
    """Not the API server's answer: the HTML page a reverse proxy or load balancer in front of it
    sends (nginx's error page) when the API server is down or slow."""
    page = (f"<html>\r\n<head><title>{code} {title}</title></head>\r\n<body>\r\n<center><h1>{code} {title}</h1>"
            "</center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")
    return ApiError(code, title.replace(" ", ""), page, plain=True, headers={"Content-Type": "text/html"})


def method_not_allowed(message: str = "the server does not allow this method on the requested resource") -> ApiError:
    return ApiError(405, "MethodNotAllowed", message)


def agent_unavailable(message: str) -> ApiError:
    """virt-api answers guest-agent calls that cannot be served with a plain-text 500."""
    return ApiError(500, "InternalError", message, plain=True)
