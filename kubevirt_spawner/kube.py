"""The only module that talks to the API server.

It uses the official `kubernetes` client for configuration and credentials, aiohttp (which
JupyterHub itself depends on) on the hub's event loop for the transport, and exchanges plain JSON
objects (dicts) so that KubeVirt and CDI kinds and core kinds are handled the same way. Requests
are retried with backoff on 429, 5xx and connection errors. It logs through the logger it is
given (the hub's).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import resource
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence
from urllib.parse import quote

import aiohttp
import orjson
from kubernetes import client, config
from kubernetes.client.rest import is_socks_proxy_url, should_bypass_proxies


@dataclass(frozen=True)
class Kind:
    kind: str
    group: str  # "" for the core group
    version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        parts = [base]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{quote(namespace, safe='')}")
        parts.append(self.plural)
        if name:
            parts.append(quote(name, safe=""))
        if subresource:
            parts.append(subresource)
        return "/".join(parts)


NAMESPACE = Kind("Namespace", "", "v1", "namespaces", namespaced=False)
SECRET = Kind("Secret", "", "v1", "secrets")
SERVICE = Kind("Service", "", "v1", "services")
PVC = Kind("PersistentVolumeClaim", "", "v1", "persistentvolumeclaims")
PV = Kind("PersistentVolume", "", "v1", "persistentvolumes", namespaced=False)
EVENT = Kind("Event", "", "v1", "events")
RESOURCE_QUOTA = Kind("ResourceQuota", "", "v1", "resourcequotas")
LIMIT_RANGE = Kind("LimitRange", "", "v1", "limitranges")
NETWORK_POLICY = Kind("NetworkPolicy", "networking.k8s.io", "v1", "networkpolicies")
ROLE_BINDING = Kind("RoleBinding", "rbac.authorization.k8s.io", "v1", "rolebindings")
NODE = Kind("Node", "", "v1", "nodes", namespaced=False)
VM = Kind("VirtualMachine", "kubevirt.io", "v1", "virtualmachines")
VMI = Kind("VirtualMachineInstance", "kubevirt.io", "v1", "virtualmachineinstances")
DV = Kind("DataVolume", "cdi.kubevirt.io", "v1beta1", "datavolumes")
SNAPSHOT = Kind("VirtualMachineSnapshot", "snapshot.kubevirt.io", "v1beta1", "virtualmachinesnapshots")
RESTORE = Kind("VirtualMachineRestore", "snapshot.kubevirt.io", "v1beta1", "virtualmachinerestores")
STORAGE_PROFILE = Kind("StorageProfile", "cdi.kubevirt.io", "v1beta1", "storageprofiles", namespaced=False)
VM_SUBRESOURCES = Kind("VirtualMachine", "subresources.kubevirt.io", "v1", "virtualmachines")
VMI_SUBRESOURCES = Kind("VirtualMachineInstance", "subresources.kubevirt.io", "v1", "virtualmachineinstances")
VOLUME_SNAPSHOT = Kind("VolumeSnapshot", "snapshot.storage.k8s.io", "v1", "volumesnapshots")

Log = logging.Logger | logging.LoggerAdapter[logging.Logger]  # the hub's logger, or an adapter of it
RETRY_STATUS = {429, 500, 502, 503, 504}
AUTH_REFRESH_SECONDS = 30.0
_WEBHOOK_UNREACHABLE = re.compile(r'failed calling webhook "([^"]+)"')
_WEBHOOK_DENIED = re.compile(r'admission webhook "[^"]+" denied the request:\s*')
_AUTHORIZER_REFUSAL = re.compile(r'forbidden: User ".*" cannot \S+ (resource|path) ')


def json_pointer_token(key: str) -> str:
    """A map key as one JSON pointer segment (RFC 6901): `~` and `/` escaped."""
    return key.replace("~", "~0").replace("/", "~1")


class KubeError(Exception):
    """A request the API server refused (or that never got an answer). `request` says which one.

    `KubeError(status, ...)` is always the subclass for its status (`NotFound`, `Forbidden`,
    `Conflict`, `TooManyRequests`, `ServerError`, `Unreachable`; other refusals, a 422 say, are
    `KubeError` itself), so callers may catch a kind. An error is not changed once made: what a
    caller learns (the admin was told; the sentence a user reads) goes into a copy (`again`)."""

    def __new__(cls, status: int, *args: object, **kwargs: object) -> KubeError:
        if cls is KubeError:
            cls = _KINDS.get(status) or (ServerError if status >= 500 else KubeError)
        return super().__new__(cls)

    def __init__(self, status: int, reason: str, message: str, body: dict[str, Any] | None = None, request: str = "",
                 from_status: bool = True, *, logged: bool = False, jupyterhub_message: str | None = None):
        """`from_status`: the answer was the API server's Status (its message is the server's own
        sentence); False for any other body (a proxy's HTML page), which no user reads. `logged`: the
        admin has been told already (a cache that may not be read says so once). `jupyterhub_message`,
        when set, is what JupyterHub shows a user whose start it ended (handlers/base.py reads it)."""
        super().__init__(status, reason, message)
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}
        self.request = request
        self.from_status = from_status
        self.logged = logged
        self.jupyterhub_message = jupyterhub_message
        self._made = True

    def __setattr__(self, name: str, value: object) -> None:
        # Made once, read by many (a cache hands the same refusal to every waiter). `reason` stays
        # writable: JupyterHub labels a failed start's exception with it (user.py: e.reason = 'error').
        if getattr(self, "_made", False) and name != "reason" and not name.startswith("__"):
            raise AttributeError(f"a KubeError is not changed once made (not even {name}): raise err.again(...)")
        super().__setattr__(name, value)

    def again(self, *, logged: bool | None = None, jupyterhub_message: str | None = None) -> KubeError:
        """The same refusal, made anew with what a caller adds: `logged` (the admin was told) or the
        sentence a user reads."""
        return KubeError(self.status, self.reason, self.message, self.body, self.request, self.from_status,
                         logged=self.logged if logged is None else logged,
                         jupyterhub_message=jupyterhub_message or self.jupyterhub_message)

    def __str__(self) -> str:
        where = f" ({self.request})" if self.request else ""
        return f"{self.status} {self.reason}: {self.message}{where}"

    @property
    def for_users(self) -> str:
        """The refusal in words a user may read: the cause, never the raw answer (an API server's
        internal error, a proxy's HTML page, a webhook's transport error). A refusal of the
        request itself (a quota, an invalid object) says why, on one line, without the webhook's
        prefix."""
        hook = _WEBHOOK_UNREACHABLE.search(self.message)
        if self.status >= 500 and hook:
            service = "CDI's cdi-api" if ".cdi." in hook.group(1) else "KubeVirt's virt-api"
            return f"{service} did not answer the cluster's API server"
        if self.status == 429:
            return "the cluster's API server is overloaded"
        if self.status == 0:
            return "the cluster's API server could not be reached"
        if self.status >= 500:
            return "the cluster's API server did not complete the request"
        if not self.from_status:  # (an HTML page from a proxy or a load balancer: not for users' eyes)
            return (f"the cluster's API server, or a proxy in front of it, refused the request (HTTP {self.status}"
                    f"{' ' + self.reason if self.reason else ''})")
        text = " ".join(_WEBHOOK_DENIED.sub("", self.message).split())
        return (text[:300].rstrip() + "...") if len(text) > 300 else (text or self.reason or f"HTTP {self.status}")

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def permission_denied(self) -> bool:
        """The authorizer's 403 (its wording: staging/src/k8s.io/apiserver/pkg/endpoints/handlers/
        responsewriters/errors.go), or CDI's webhook refusing a clone from a namespace the hub may
        not clone from (a 422: pkg/apiserver/webhooks/datavolume-mutate.go). Other 403s (a quota,
        a namespace being deleted, a disk that cannot grow) are not about permissions."""
        if self.status == 403:
            return bool(_AUTHORIZER_REFUSAL.search(self.message))
        return self.status == 422 and 'admission webhook "datavolume-mutate.cdi.kubevirt.io"' in self.message \
            and "insufficient permissions" in self.message


class Unreachable(KubeError):
    """No answer: the API server could not be reached, or the connection broke (status 0)."""


class Forbidden(KubeError):
    """403: the authorizer's refusal, or a quota, or a namespace being deleted (see `permission_denied`)."""


class NotFound(KubeError):
    """404: the object, or the kind (an API the cluster does not serve)."""


class Conflict(KubeError):
    """409: the object exists already, its resourceVersion changed, or a subresource's state refuses."""


class TooManyRequests(KubeError):
    """429: API priority and fairness, or an eviction a disruption budget refuses."""


class ServerError(KubeError):
    """5xx: the API server, a webhook behind it, or a proxy in front of it failed."""


_KINDS: dict[int, type[KubeError]] = {0: Unreachable, 403: Forbidden, 404: NotFound, 409: Conflict,
                                      429: TooManyRequests}


def _object(answer: dict[str, Any] | None, method: str, path: str) -> dict[str, Any]:
    """The object a write or a list answers with: an answer without one is the server's failure."""
    if answer is None:
        raise KubeError(500, "InternalError", "the API server answered without an object", request=f"{method} {path}")
    return answer


def _seconds(header: str | None) -> float:
    """A Retry-After header in seconds (the API server sends whole seconds); 0 when absent."""
    try:
        return max(0.0, float(header)) if header else 0.0
    except ValueError:
        return 0.0


def _error_from(status: int, data: bytes, fallback: str = "", request: str = "") -> KubeError:
    text = (data or b"").decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("kind") == "Status":
        return KubeError(status, body.get("reason", ""), body.get("message", text), body, request)
    # Not the API server's Status (a proxy's page): one line, bounded, for the admin's log only.
    line = " ".join(text.split())
    return KubeError(status, fallback, (line[:300] + "...") if len(line) > 300 else (line or fallback),
                     request=request, from_status=False)


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> client.ApiClient:
    """In-cluster credentials when running in a pod without a kubeconfig, else the kubeconfig."""
    cfg = client.Configuration()
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        except config.ConfigException:
            pass  # not in a pod: the kubeconfig below
    config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    return client.ApiClient(cfg)


def raise_open_files_limit(log: Log) -> None:
    """Raise this process's soft limit of open files to its hard limit, as Go programs do at start
    (os/rlimit.go): each watch holds a connection, seven per watched namespace, and a container's
    soft limit may be 1024 (containerd 2's default) while its hard limit is far higher."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("raised the limit of open files from %d to %d: each watch holds a connection", soft, hard)
        except (OSError, ValueError) as err:
            log.warning("could not raise the limit of open files from %d (%s): watching many namespaces may "
                        "run out of them", soft, err)


def ssl_context(cfg: client.Configuration) -> ssl.SSLContext | bool:
    """TLS as the official client sets it up from a configuration (kubernetes/client/rest.py):
    its CA (file or data, else the system's), client certificate, hostname check; False when the
    configuration says not to verify."""
    if not cfg.verify_ssl:
        return False
    context = ssl.create_default_context(cafile=cfg.ssl_ca_cert, cadata=cfg.ca_cert_data)
    if cfg.cert_file:
        context.load_cert_chain(cfg.cert_file, cfg.key_file)
    if cfg.assert_hostname is False:
        context.check_hostname = False
    return context


def proxy_settings(cfg: client.Configuration) -> dict[str, Any]:
    """The proxy arguments of a request to the API server, as the official client chooses them."""
    if not cfg.proxy or should_bypass_proxies(cfg.host, cfg.no_proxy or ""):
        return {}
    if is_socks_proxy_url(cfg.proxy):
        raise ValueError(f"the API server's proxy {cfg.proxy} is a SOCKS proxy, which kubevirt-spawner does not "
                         "support: use an HTTP proxy or none")
    return {"proxy": cfg.proxy, "proxy_headers": cfg.proxy_headers or None}


class Kube:
    """Requests and watches on the event loop (aiohttp): no threads, so nothing of the spawner
    competes with the hub's loop for the interpreter; credentials are refreshed off the loop."""

    def __init__(self, api_client: client.ApiClient, log: Log,
                 request_timeout: float = 30.0, retry_timeout: float = 60.0):
        self.api = api_client
        self.log = log
        self.request_timeout = request_timeout
        self.retry_timeout = retry_timeout
        cfg = api_client.configuration
        self.base = cfg.host.rstrip("/")
        self._ssl = ssl_context(cfg)
        self._proxy = proxy_settings(cfg)
        self._server_hostname = cfg.tls_server_name or None
        self._closed = False
        self._auth: tuple[float, dict[str, str]] = (0.0, {})
        # A credential refresh may run a command (an exec plugin) or read a file: never on the loop.
        self._refresher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kube-credentials")
        # Requests share a bounded pool; watches (one per kind and watched namespace, each holding
        # its connection for minutes) have their own, so that they never starve the requests.
        self._sessions: dict[bool, aiohttp.ClientSession] = {}
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def _session_now(self, watch: bool = False) -> aiohttp.ClientSession:
        """The session of the running loop (a test may run several loops, one after another), for
        watches or for requests."""
        loop = asyncio.get_running_loop()
        if self._session_loop is not loop:
            self._sessions, self._session_loop = {}, loop
        session = self._sessions.get(watch)
        if session is None or session.closed:
            if watch:
                raise_open_files_limit(self.log)
            session = self._sessions[watch] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0 if watch else 64, ssl=self._ssl), trust_env=False,
                headers={"Accept": "application/json", "User-Agent": self.api.user_agent})
        return session

    def _read_credentials(self) -> dict[str, str]:
        return {auth["key"]: auth["value"] for auth in self.api.configuration.auth_settings().values()
                if auth.get("in") == "header" and auth.get("value")}

    async def _auth_headers(self) -> dict[str, str]:
        """The credentials' headers, read again every AUTH_REFRESH_SECONDS: the client's refresh hook
        re-reads the kubeconfig or the token file (a ServiceAccount token is rotated hourly, an exec
        plugin's lasts minutes)."""
        fetched, headers = self._auth
        if time.monotonic() - fetched < AUTH_REFRESH_SECONDS:
            return headers
        headers = await asyncio.get_running_loop().run_in_executor(self._refresher, self._read_credentials)
        self._auth = (time.monotonic(), headers)
        return headers

    def _options(self, headers: dict[str, Any], timeout: aiohttp.ClientTimeout) -> dict[str, Any]:
        options = {"headers": headers, "timeout": timeout, "allow_redirects": False, **self._proxy}
        if self._server_hostname:
            options["server_hostname"] = self._server_hostname
        return options

    async def _exchange(self, method: str, path: str, query: dict[str, Any] | None, body: object,
                        content_type: str | None) -> tuple[int, bytes, str, str | None]:
        headers = dict(await self._auth_headers())
        data = None
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
            data = orjson.dumps(body)
        async with self._session_now().request(
                method, self.base + path, params=query, data=data,
                **self._options(headers, aiohttp.ClientTimeout(total=self.request_timeout))) as resp:
            return resp.status, await resp.read(), resp.reason or "", resp.headers.get("Retry-After")

    async def _request(self, method: str, path: str, query: dict[str, Any] | None, body: object,
                       content_type: str | None,
                       repeatable: bool) -> dict[str, Any] | None:
        deadline = time.monotonic() + self.retry_timeout
        attempt = 0
        request = f"{method} {path}"
        while True:
            attempt += 1
            retry_after = 0.0
            try:
                status, data, reason, retry_header = await self._exchange(method, path, query, body, content_type)
                if status < 400:
                    if not data:
                        return None
                    try:
                        answer = orjson.loads(data)
                    except ValueError:
                        return None
                    return answer if isinstance(answer, dict) else None  # (the API answers with objects)
                err = _error_from(status, data, reason, request)
                retry_after = _seconds(retry_header)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                err = KubeError(0, "ConnectionError", f"cannot reach the API server: {exc or type(exc).__name__}",
                                request=request)
            if err.status == 401 and self._auth[0] and attempt == 1:
                self._auth = (0.0, {})  # the token was rotated since it was read: read it again, once
                continue
            if err.status != 429 and (not repeatable or (err.status not in RETRY_STATUS and err.status != 0)):
                raise err
            delay = max(min(0.2 * 2 ** (attempt - 1), 5.0) * (0.5 + random.random() / 2), retry_after)
            if time.monotonic() + delay > deadline or self._closed:
                raise err
            self.log.info("%s %s failed (%s); retry %d in %.1fs", method, path, err, attempt, delay)
            await asyncio.sleep(delay)

    async def watch(self, path: str, query: dict[str, Any], read_timeout: float) -> AsyncIterator[list[dict[str, Any]]]:
        """A watch: the events of each piece the server sends (one per line), decoded, in order; a
        storm of changes arrives in few pieces. Errors surface as KubeError."""
        request = f"WATCH {path}"
        headers = await self._auth_headers()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.request_timeout, sock_read=read_timeout)
        try:
            async with self._session_now(watch=True).get(self.base + path, params=query,
                                               **self._options(headers, timeout)) as resp:
                if resp.status >= 400:
                    if resp.status == 401:
                        self._auth = (0.0, {})  # a rotated token: the next watch reads it again
                    raise _error_from(resp.status, await resp.read(), resp.reason or "", request)
                buffer = b""
                async for chunk in resp.content.iter_any():
                    lines = (buffer + chunk).split(b"\n")
                    buffer = lines.pop()  # the start of a line still on its way
                    events = [orjson.loads(line) for line in lines if line.strip()]
                    if events:
                        yield events
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise KubeError(0, "ConnectionError", f"watch stream broke: {exc or type(exc).__name__}",
                            request=request) from None

    # ------------------------------------------------------------ async API
    async def call(self, method: str, path: str, query: dict[str, Any] | None = None, body: object = None,
                   content_type: str | None = None, repeatable: bool = True) -> dict[str, Any] | None:
        """One API call with retries, with backoff and as long as `retry_timeout` allows, on 429
        (after the server's Retry-After at least) and, for a `repeatable` call, on 5xx and
        connection errors; the answer's JSON or None. A call that must not happen twice (a restart)
        is not `repeatable`: a timeout or a 5xx may come after it took effect, a 429 never does."""
        task = asyncio.ensure_future(self._request(method, path, query, body, content_type, repeatable))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # A request on its way cannot be called back: let it land before the caller cleans
            # up, so that (say) a stop after a cancelled start is not overtaken by the start.
            await asyncio.wait([task])
            raise

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self.call("GET", kind.path(namespace, name))
        except KubeError as err:
            if err.not_found:
                return None
            raise

    async def list(self, kind: Kind, namespace: str | None = None, label_selector: str | None = None,
                   field_selector: str | None = None) -> dict[str, Any]:
        query = {"labelSelector": label_selector, "fieldSelector": field_selector}
        return _object(await self.call("GET", kind.path(namespace), {k: v for k, v in query.items() if v} or None),
                       "GET", kind.path(namespace))

    async def create(self, kind: Kind, obj: dict[str, Any], query: dict[str, Any] | None = None) -> dict[str, Any]:
        path = kind.path(obj["metadata"].get("namespace"))
        return _object(await self.call("POST", path, query, obj), "POST", path)

    async def replace(self, kind: Kind, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        path = kind.path(meta.get("namespace"), meta["name"])
        return _object(await self.call("PUT", path, None, obj), "PUT", path)

    async def patch(self, kind: Kind, namespace: str | None, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        path = kind.path(namespace, name)
        return _object(await self.call("PATCH", path, None, patch, "application/merge-patch+json"), "PATCH", path)

    async def json_patch(self, kind: Kind, namespace: str | None, name: str, ops: Sequence[dict[str, Any]],
                         query: dict[str, Any] | None = None) -> dict[str, Any]:
        """An RFC 6902 patch: unlike a merge patch, `replace` drops what the new value leaves out."""
        path = kind.path(namespace, name)
        return _object(await self.call("PATCH", path, query, ops, "application/json-patch+json"), "PATCH", path)

    async def delete(self, kind: Kind, namespace: str | None, name: str) -> bool:
        """Delete; False when it was already gone."""
        try:
            await self.call("DELETE", kind.path(namespace, name), None, {"propagationPolicy": "Background"})
            return True
        except KubeError as err:
            if err.not_found:
                return False
            raise

    async def vm_action(self, namespace: str, name: str, action: str, body: dict[str, Any] | None = None) -> None:
        """KubeVirt's start/stop/restart subresource calls (PUT, answered with 202). Start and stop
        may be sent again (a second one is refused with 409, which callers expect); a restart that
        may have landed must not be: it would restart the machine twice."""
        await self.call("PUT", VM_SUBRESOURCES.path(namespace, name, action), None, body or {},
                        repeatable=action != "restart")

    async def aclose(self) -> None:
        self._closed = True
        for session in self._sessions.values():
            await session.close()
        self._refresher.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop retrying; the connections close with their loop (or `aclose()` on it)."""
        self._closed = True
        self._refresher.shutdown(wait=False, cancel_futures=True)
