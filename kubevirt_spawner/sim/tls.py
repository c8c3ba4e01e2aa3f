"""The simulator's serving certificate: an API server speaks HTTPS, and kubectl sends credentials
only over TLS (client-go's clientcmd drops the user's token for an http:// server).

A cluster CA and a server certificate for 127.0.0.1 are made once per state directory, so a
kubeconfig stays valid across restarts, as a real cluster's does.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class ServingCertificate:
    ca: str  # PEM file of the cluster CA (what a kubeconfig's certificate-authority-data holds)
    cert: str
    key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: str, data: bytes):
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.chmod(path + ".tmp", 0o600)
    os.replace(path + ".tmp", path)


def ensure_serving_certificate(state_dir: str) -> ServingCertificate:
    folder = os.path.join(state_dir, "pki")
    out = ServingCertificate(os.path.join(folder, "ca.crt"), os.path.join(folder, "apiserver.crt"),
                             os.path.join(folder, "apiserver.key"))
    if all(os.path.exists(p) for p in (out.ca, out.cert, out.key)):
        return out
    os.makedirs(folder, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    not_after = now + datetime.timedelta(days=3650)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(_name("kubevirt-sim-ca")).issuer_name(_name("kubevirt-sim-ca"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(not_after)
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False),
                              critical=True)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.DNSName("kubernetes"), x509.DNSName("kubernetes.default.svc"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder().subject_name(_name("kube-apiserver")).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(out.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    _write(out.cert, cert.public_bytes(serialization.Encoding.PEM))
    _write(out.ca, ca_cert.public_bytes(serialization.Encoding.PEM))
    return out
