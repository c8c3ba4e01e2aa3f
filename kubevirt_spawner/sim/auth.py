"""Authentication: who sends a request, from its bearer token.

Two kinds of token exist, as on a kubeadm cluster: the admin kubeconfig's (a member of
`system:masters`, which no authorizer refuses) and ServiceAccount tokens from the TokenRequest
API (`POST .../serviceaccounts/NAME/token`, what `kubectl create token` calls). Those are signed
JWTs bound to the ServiceAccount's uid: they stop working when it is deleted, or when they expire
(pkg/serviceaccount/claims.go, pkg/registry/core/serviceaccount/storage/token.go).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
import uuid
from dataclasses import dataclass

from . import errors
from .resources import BY_KIND
from .timeutil import iso

ADMIN_TOKEN = "kubevirt-sim-admin"
API_AUDIENCE = "https://kubernetes.default.svc.cluster.local"  # the API server's default --api-audiences
DEFAULT_EXPIRATION = 3600
MIN_EXPIRATION = 600


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...]

    @property
    def superuser(self) -> bool:
        return "system:masters" in self.groups


ADMIN = User("kubernetes-admin", ("system:masters", "system:authenticated"))
ANONYMOUS = User("system:anonymous", ("system:unauthenticated",))


def service_account_user(namespace: str, name: str) -> User:
    return User(f"system:serviceaccount:{namespace}:{name}",
                ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"))


def unauthorized() -> errors.ApiError:
    return errors.ApiError(401, "Unauthorized", "Unauthorized")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Authenticator:
    """Issues and checks ServiceAccount tokens; the signing key is kept in the state directory,
    so tokens survive a simulator restart as they survive an API server restart."""

    def __init__(self, store, state_dir: str):
        self.store = store
        path = os.path.join(state_dir, "sa-signing.key")
        try:
            with open(path, "rb") as f:
                self.key = f.read()
        except FileNotFoundError:
            self.key = secrets.token_bytes(32)
            fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self.key)
            os.replace(path + ".tmp", path)

    def _sign(self, text: str) -> str:
        return _b64(hmac.new(self.key, text.encode(), hashlib.sha256).digest())

    def issue(self, service_account: dict, body: dict | None) -> dict:
        """Answer a TokenRequest for the ServiceAccount: the TokenRequest with its status."""
        spec = (body or {}).get("spec") or {}
        seconds = spec.get("expirationSeconds")
        seconds = DEFAULT_EXPIRATION if seconds is None else seconds
        meta = service_account["metadata"]
        if not isinstance(seconds, int) or seconds < MIN_EXPIRATION:
            # Validation names the TokenRequest as sent, which kubectl sends without a name.
            asked = ((body or {}).get("metadata") or {}).get("name", "")
            raise errors.ApiError(422, "Invalid", f'TokenRequest.authentication.k8s.io "{asked}" is invalid: '
                                  "spec.expirationSeconds: Invalid value: "
                                  f"{seconds}: may not specify a duration less than 10 minutes",
                                  {"name": asked, "group": "authentication.k8s.io", "kind": "TokenRequest",
                                   "causes": [{"reason": "FieldValueInvalid", "field": "spec.expirationSeconds",
                                               "message": f"Invalid value: {seconds}: may not specify a duration "
                                                          "less than 10 minutes"}]})
        audiences = list(spec.get("audiences") or [API_AUDIENCE])
        now = int(time.time())
        claims = {"aud": audiences, "exp": now + seconds, "iat": now, "nbf": now, "iss": API_AUDIENCE,
                  "jti": str(uuid.uuid4()), "sub": f"system:serviceaccount:{meta['namespace']}:{meta['name']}",
                  "kubernetes.io": {"namespace": meta["namespace"],
                                    "serviceaccount": {"name": meta["name"], "uid": meta["uid"]}}}
        head = _b64(json.dumps({"alg": "HS256", "kid": "kubevirt-sim", "typ": "JWT"}).encode())
        payload = _b64(json.dumps(claims, separators=(",", ":")).encode())
        token = f"{head}.{payload}.{self._sign(head + '.' + payload)}"
        return {"kind": "TokenRequest", "apiVersion": "authentication.k8s.io/v1",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                             "creationTimestamp": iso(now)},
                "spec": {"audiences": audiences, "expirationSeconds": seconds, "boundObjectRef": None},
                "status": {"token": token, "expirationTimestamp": iso(now + seconds)}}

    def authenticate(self, authorization: str | None) -> User:
        """The user a request's Authorization header names; no header is the anonymous user, a
        header that names nobody is 401 Unauthorized."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return ANONYMOUS  # no bearer token: the next authenticator, then anonymous

        if hmac.compare_digest(token, ADMIN_TOKEN):
            return ADMIN
        claims = self._verify(token)
        if claims is None:
            raise unauthorized()
        ns = claims["kubernetes.io"]["namespace"]
        name = claims["kubernetes.io"]["serviceaccount"]["name"]
        return service_account_user(ns, name)

    def _verify(self, token: str) -> dict | None:
        parts = token.split(".")
        if len(parts) != 3 or not hmac.compare_digest(parts[2], self._sign(parts[0] + "." + parts[1])):
            return None
        try:
            claims = json.loads(_unb64(parts[1]))
            ns = claims["kubernetes.io"]["namespace"]
            sa = claims["kubernetes.io"]["serviceaccount"]
        except (ValueError, KeyError, TypeError):
            return None
        if claims.get("exp", 0) < time.time() or API_AUDIENCE not in (claims.get("aud") or []):
            return None
        # A bound token is only good while its ServiceAccount (that very one, by uid) exists.
        current = self.store.get(BY_KIND["ServiceAccount"], ns, sa.get("name", ""))
        if current is None or current["metadata"]["uid"] != sa.get("uid"):
            return None
        return claims
