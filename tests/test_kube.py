"""The API client's request line: looked up once per client, right with and without a proxy."""

import logging

import urllib3
from kubernetes import client

from kubevirt_spawner import kube as k


def kube_for(host: str, proxy: str | None = None) -> k.Kube:
    cfg = client.Configuration()
    cfg.host = host
    cfg.proxy = proxy
    return k.Kube(client.ApiClient(cfg), logging.getLogger("test"))


def test_requests_name_the_path_only_without_a_proxy_or_over_tls():
    for host, proxy in (("https://api.example:6443", None), ("https://api.example:6443", "http://proxy:3128"),
                        ("http://127.0.0.1:8001", None)):
        pool, prefix = kube_for(host, proxy)._pool()
        assert prefix == "" and pool.host in ("api.example", "127.0.0.1")


def test_a_plain_http_api_server_behind_a_proxy_gets_the_whole_url():
    pool, prefix = kube_for("http://api.example:8080", "http://proxy:3128")._pool()
    assert prefix == "http://api.example:8080"
    assert isinstance(pool, urllib3.HTTPConnectionPool) and pool.host == "proxy"


def test_a_host_with_a_path_prefix_keeps_it():
    """kubectl proxy --api-prefix, or a gateway that serves the API under a path."""
    pool, prefix = kube_for("https://gw.example/k8s/")._pool()
    assert prefix == "/k8s" and pool.host == "gw.example"
