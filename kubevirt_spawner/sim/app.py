"""Running the simulator: as a command (`kubevirt-spawner sim`) or in a background thread."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import ssl
import threading

import tornado.httpserver
import yaml

from .auth import ADMIN_TOKEN
from .cluster import Cluster
from .server import make_app
from .tls import ensure_serving_certificate

log = logging.getLogger(__name__)


def _not_a_client_hanging_up(record: logging.LogRecord) -> bool:
    """Tornado warns about a TLS alert a client sends as it drops a watch (urllib3 shuts the socket
    down under a blocked read); that is a client hanging up, which an API server does not log."""
    return not record.getMessage().startswith("error on read: [SSL: TLSV1_ALERT_DECODE_ERROR]")


logging.getLogger("tornado.general").addFilter(_not_a_client_hanging_up)


def write_kubeconfig(path: str, server: str, ca_file: str, user: str, token: str, namespace: str = "default") -> str:
    """A kubeconfig for the simulated cluster that authenticates with `token` (the admin's, or a
    ServiceAccount's from the TokenRequest API) and trusts the cluster's CA."""
    with open(ca_file, "rb") as f:
        ca_data = base64.b64encode(f.read()).decode()
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "kubevirt-sim",
              "clusters": [{"name": "kubevirt-sim", "cluster": {"server": server,
                                                                 "certificate-authority-data": ca_data}}],
              "users": [{"name": user, "user": {"token": token}}],
              "contexts": [{"name": "kubevirt-sim", "context": {"cluster": "kubevirt-sim", "user": user,
                                                                "namespace": namespace}}]}
    with open(path + ".tmp", "w") as f:
        yaml.safe_dump(config, f)
    os.replace(path + ".tmp", path)
    return path


class Simulator:
    """A cluster plus its HTTP server on one event loop."""

    def __init__(self, state_dir: str, port: int = 0, **cluster_options):
        self.state_dir = os.path.abspath(state_dir)
        self.cluster = Cluster(self.state_dir, **cluster_options)
        self.requested_port = port
        self.port: int | None = None
        self._server: tornado.httpserver.HTTPServer | None = None
        self.certificate = ensure_serving_certificate(self.state_dir)

    async def start(self):
        await self.cluster.start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.requested_port))
        sock.listen(1024)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(self.certificate.cert, self.certificate.key)
        self._server = tornado.httpserver.HTTPServer(make_app(self.cluster), idle_connection_timeout=3600,
                                                     ssl_options=tls)
        self._server.add_sockets([sock])
        self.kubeconfig = write_kubeconfig(os.path.join(self.state_dir, "kubeconfig"), self.url, self.ca_file,
                                           "kubernetes-admin", ADMIN_TOKEN)
        with open(os.path.join(self.state_dir, "sim.json"), "w") as f:
            json.dump({"url": self.url, "kubeconfig": self.kubeconfig, "pid": os.getpid()}, f)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> str:
        """The cluster CA's certificate (PEM): what clients verify the simulator's HTTPS with."""
        return self.certificate.ca

    async def stop(self):
        if self._server is not None:
            self._server.stop()
        self.cluster.store.cut_watches()
        await self.cluster.stop()
        if self._server is not None:
            await self._server.close_all_connections()


class SimulatorThread:
    """The simulator on its own event loop in a daemon thread: what tests and the demo embed."""

    def __init__(self, state_dir: str, port: int = 0, **cluster_options):
        self.sim = Simulator(state_dir, port, **cluster_options)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kubevirt-sim", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def _run(self):
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.sim.start())
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def start(self, timeout: float = 30) -> "SimulatorThread":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the simulator did not start in time")
        if self._error:
            raise self._error
        return self

    def call(self, fn, *args, timeout: float = 30):
        """Run `fn(*args)` on the simulator's loop (coroutine functions are awaited) and return its result."""
        async def runner():
            result = fn(*args)
            if asyncio.iscoroutine(result):
                result = await result
            return result
        return asyncio.run_coroutine_threadsafe(runner(), self.loop).result(timeout)

    def stop(self):
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.sim.stop(), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)

    @property
    def url(self) -> str:
        return self.sim.url

    @property
    def kubeconfig(self) -> str:
        return self.sim.kubeconfig

    @property
    def ca_file(self) -> str:
        return self.sim.ca_file

    @property
    def cluster(self) -> Cluster:
        return self.sim.cluster


async def serve_forever(state_dir: str, port: int, **cluster_options):
    sim = Simulator(state_dir, port, **cluster_options)
    await sim.start()
    print(f"kubevirt simulator listening on {sim.url}; kubeconfig: {sim.kubeconfig}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await sim.stop()
