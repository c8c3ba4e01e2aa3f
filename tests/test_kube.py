"""The API client's transport settings, taken from the official client's configuration as its own
REST client takes them (kubernetes/client/rest.py): TLS verification, CA, proxy and no_proxy."""

import ssl

import pytest
from kubernetes import client

from kubevirt_spawner import kube as k


def configuration(host: str = "https://api.example:6443", **settings) -> client.Configuration:
    cfg = client.Configuration()
    cfg.host = host
    for key, value in settings.items():
        setattr(cfg, key, value)
    return cfg


def test_tls_is_verified_against_the_configured_ca_with_the_hostname_checked(tmp_path):
    from kubevirt_spawner.sim.tls import ensure_serving_certificate
    ca = ensure_serving_certificate(str(tmp_path)).ca
    context = k.ssl_context(configuration(ssl_ca_cert=ca))
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert len(context.get_ca_certs()) == 1  # the cluster's CA only, not the system's


def test_insecure_skip_tls_verify_and_assert_hostname_false_are_honoured():
    assert k.ssl_context(configuration(verify_ssl=False)) is False
    context = k.ssl_context(configuration(assert_hostname=False))
    assert isinstance(context, ssl.SSLContext) and not context.check_hostname


def test_proxy_is_used_unless_no_proxy_names_the_api_server():
    assert k.proxy_settings(configuration()) == {}
    assert k.proxy_settings(configuration(proxy="http://proxy:3128")) == {"proxy": "http://proxy:3128",
                                                                         "proxy_headers": None}
    assert k.proxy_settings(configuration(proxy="http://proxy:3128", no_proxy="api.example")) == {}


def test_a_socks_proxy_is_refused_with_a_sentence():
    with pytest.raises(ValueError, match="SOCKS proxy, which kubevirt-spawner does not support"):
        k.proxy_settings(configuration(proxy="socks5://proxy:1080"))


@pytest.mark.parametrize(("status", "message", "words"), [
    # the API server's own refusal when a validating webhook cannot be called (apiserver's
    # validating dispatcher: NewInternalError of ErrCallingWebhook)
    (500, 'Internal error occurred: failed calling webhook "virtualmachine-validator.kubevirt.io": failed to call '
          'webhook: Post "https://virt-api.kubevirt.svc:443/virtualmachines-validate?timeout=10s": dial tcp '
          '10.96.0.25:443: connect: connection refused', "KubeVirt's virt-api did not answer the cluster's API server"),
    (500, 'Internal error occurred: failed calling webhook "datavolume-validate.cdi.kubevirt.io": context deadline '
          'exceeded', "CDI's cdi-api did not answer the cluster's API server"),
    (500, "Internal error occurred: etcdserver: request timed out", "the cluster's API server did not complete the request"),
    (502, "<html><body><h1>502 Bad Gateway</h1></body></html>", "the cluster's API server did not complete the request"),
    (429, "Too many requests, please try again later.", "the cluster's API server is overloaded"),
    (0, "cannot reach the API server: Connection refused", "the cluster's API server could not be reached"),
    # a refusal of the request itself says why, without the webhook's prefix, on one line
    (422, 'admission webhook "virtualmachine-validator.kubevirt.io" denied the request: spec.template: bad\nsecond',
     "spec.template: bad second"),
    (403, 'persistentvolumeclaims "a" is forbidden: exceeded quota: disks, requested: requests.storage=60Gi',
     'persistentvolumeclaims "a" is forbidden: exceeded quota: disks, requested: requests.storage=60Gi'),
])
def test_a_refusal_in_words_a_user_may_read(status, message, words):
    assert k.KubeError(status, "", message).for_users == words


def test_a_proxys_page_in_front_of_the_api_server_is_never_shown_to_users():
    """A body that is not the API server's Status (an ingress's or an auth proxy's HTML page, say)
    is one line in the admin's log and a fixed sentence for users, whatever its status."""
    page = b"<html>\n<head><title>403 Forbidden</title></head>\n<body><center><h1>403 Forbidden</h1></center>" + \
        b"<hr><center>nginx</center>" + b" " * 4000 + b"</body></html>"
    err = k._error_from(403, page, "Forbidden", "POST /apis/cdi.kubevirt.io/v1beta1/namespaces/a/datavolumes")
    assert err.for_users == "the cluster's API server, or a proxy in front of it, refused the request (HTTP 403 Forbidden)"
    assert "\n" not in err.message and len(err.message) <= 303 and err.message.startswith("<html> <head>")
    assert not err.permission_denied and not err.not_found
    status = k._error_from(403, b'{"kind": "Status", "reason": "Forbidden", "message": "exceeded quota: disks"}',
                           "Forbidden")
    assert status.for_users == "exceeded quota: disks"


@pytest.mark.parametrize(("status", "kind"), [
    (0, k.Unreachable), (403, k.Forbidden), (404, k.NotFound), (409, k.Conflict), (429, k.TooManyRequests),
    (500, k.ServerError), (502, k.ServerError), (504, k.ServerError), (422, k.KubeError), (410, k.KubeError),
])
def test_an_error_is_the_kind_of_its_status(status, kind):
    err = k.KubeError(status, "", "said")
    assert type(err) is kind and isinstance(err, k.KubeError)
    assert type(k._error_from(status, b"<html></html>", "Bad")) is kind
    assert type(err.again(logged=True)) is kind


def test_an_error_is_not_changed_once_made_only_copied():
    """A cache hands the same refusal to every waiter: nobody may change it under the others. What a
    caller adds goes into a copy; `reason` stays writable because JupyterHub labels a failed start's
    exception with it (jupyterhub/user.py, User.spawn: e.reason = 'error')."""
    err = k.KubeError(403, "Forbidden", 'User "x" cannot list resource "pods"', request="GET /api/v1/pods")
    for name, value in (("logged", True), ("jupyterhub_message", "hi"), ("message", "other"), ("status", 500)):
        with pytest.raises(AttributeError, match="not changed once made"):
            setattr(err, name, value)
    told = err.again(logged=True)
    assert told.logged and not err.logged
    said = told.again(jupyterhub_message="The cluster refused.")
    assert said.logged and said.jupyterhub_message == "The cluster refused." and err.jupyterhub_message is None
    assert (said.status, said.reason, said.message, said.request) == (403, "Forbidden", err.message, err.request)
    err.reason = "error"
    try:
        raise said from err
    except k.KubeError as caught:
        assert caught.__cause__ is err


def test_a_long_refusal_is_cut_for_users():
    said = k.KubeError(422, "Invalid", "x" * 1000).for_users
    assert len(said) == 303 and said.endswith("...")
