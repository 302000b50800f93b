"""A throwaway certificate authority for ``kvpool up --secure`` and the tests.

``ThrowawayCA(folder)`` makes a CA key and certificate there; ``issue(common_name)``
makes a certificate for one process whose common name is its role (and, for
a store, ``store/<segment_id>``), valid for loopback and the given hosts.
Keys are written with mode 0600. Nothing here is meant to outlive the cluster.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = datetime.timedelta(days=7)


@dataclass(frozen=True, slots=True)
class Identity:
    """Where one process's credentials lie: the CA, its certificate, its key."""

    ca: Path
    cert: Path
    key: Path

    def flags(self) -> list[str]:
        return ["--tls-ca", str(self.ca), "--tls-cert", str(self.cert), "--tls-key", str(self.key)]

    def env(self) -> dict[str, str]:
        return {"KVPOOL_TLS_CA": str(self.ca), "KVPOOL_TLS_CERT": str(self.cert), "KVPOOL_TLS_KEY": str(self.key)}


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)


class ThrowawayCA:
    """A CA whose key never leaves ``folder``."""

    def __init__(self, folder: Path, hosts: tuple[str, ...] = ()) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.hosts = ("127.0.0.1", "::1", "localhost", *hosts)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvpool throwaway CA")])
        self._name = name
        self._cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self._key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID_FOR)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca_path = folder / "ca.pem"
        self.ca_path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, common_name: str, file_stem: str | None = None) -> Identity:
        """A certificate for ``common_name``, usable as TLS server and client."""
        stem = file_stem or common_name.replace("/", "-")
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        names: list[x509.GeneralName] = []
        for host in dict.fromkeys(self.hosts):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID_FOR)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )
        cert_path = self.folder / f"{stem}.pem"
        key_path = self.folder / f"{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
        return Identity(self.ca_path, cert_path, key_path)
