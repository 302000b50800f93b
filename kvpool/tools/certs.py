"""A throwaway certificate authority for ``kvpool up --secure``, ``kvpool certs`` and the tests.

``ThrowawayCA(folder)`` makes a CA key and certificate there; ``issue(common_name)``
makes a certificate for one process whose common name is its role (and, for
a store, ``store/<segment_id>``), valid for loopback and the given hosts.
Every folder is this user's alone, mode 0700, and every file a new one renamed into
place, keys mode 0600 (``kvpool.secret_files``): a file another user left at a name
is replaced, never written into. The CA's key is never written: nothing can be
issued by it once the object is gone, so a new certificate means a new CA.
``write_compose_credentials`` gives each of compose.yaml's services a folder of
its own (``kvpool certs``).
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvpool.secret_files import private_folder, write_secret

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


PUBLIC_MODE = 0o644  # certificates: public, in a folder only this user enters


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    write_secret(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))


class ThrowawayCA:
    """A CA whose key never leaves ``folder``."""

    def __init__(self, folder: Path, hosts: tuple[str, ...] = (), valid_for: datetime.timedelta = VALID_FOR) -> None:
        self.folder = folder
        self.valid_for = valid_for
        private_folder(folder, "certs folder")
        self.hosts = ("127.0.0.1", "::1", "localhost", *hosts)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvpool throwaway CA")])
        self._name = name
        self._cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self._key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + valid_for)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca_path = folder / "ca.pem"
        write_secret(self.ca_path, self._cert.public_bytes(serialization.Encoding.PEM), PUBLIC_MODE)

    def issue(self, common_name: str, file_stem: str | None = None) -> Identity:
        """A certificate for ``common_name``, usable as TLS server and client: ``<stem>.pem`` and
        ``<stem>.key`` beside the CA."""
        stem = file_stem or common_name.replace("/", "-")
        return self._write(common_name, self.ca_path, self.folder / f"{stem}.pem", self.folder / f"{stem}.key")

    def issue_into(self, common_name: str, folder: Path) -> Identity:
        """A certificate for ``common_name`` in a folder of its own, with a copy of the CA's: ``ca.pem``,
        ``cert.pem``, ``key.pem``, what one container mounts (and nothing of another's)."""
        private_folder(folder, "certs folder")
        ca = write_secret(folder / "ca.pem", self.ca_path.read_bytes(), PUBLIC_MODE)
        return self._write(common_name, ca, folder / "cert.pem", folder / "key.pem")

    def _write(self, common_name: str, ca_path: Path, cert_path: Path, key_path: Path) -> Identity:
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
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + self.valid_for)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )
        write_secret(cert_path, cert.public_bytes(serialization.Encoding.PEM), PUBLIC_MODE)
        _write_key(key_path, key)
        return Identity(ca_path, cert_path, key_path)


# compose.yaml's services and the common name each one's certificate carries (a store's names its
# --segment-id); tests/unit/test_deploy_files.py holds the two files to each other. "client" is the
# operator's: its folder also holds the API key the OpenAI client sends.
COMPOSE_IDENTITIES = {
    "master": "master", "store-0": "store/store-0", "store-1": "store/store-1",
    **{f"prefill-{i}": "prefill" for i in range(4)}, "decode-0": "decode", "router": "router", "client": "client",
    # compose.standby.yaml's: etcd (it asks every client for a certificate of the CA) and the master's standby
    "etcd": "etcd", "master-standby": "master",
}
MONITOR = "monitor"  # the scraper's role and folder (docs/operations.md, "Scraping the admin ports")
API_KEYS_FILE = "api_keys"  # in the router's folder: the keys it accepts (deploy/compose/cluster.toml)
API_KEY_FILE = "api_key"  # in the client's folder: the key to send


def write_compose_credentials(folder: Path, hosts: tuple[str, ...] = (),
                              valid_for: datetime.timedelta = VALID_FOR) -> dict[str, Identity]:
    """A new CA in ``folder`` and one folder per compose service (``folder/<service>/``) and for a metrics
    scraper (``folder/monitor/``), plus one API key:
    in the router's folder as its keys file, in the client's as the key to send. Every secret is mode 0600."""
    ca = ThrowawayCA(folder, hosts, valid_for)
    identities = {name: ca.issue_into(common_name, folder / name) for name, common_name in COMPOSE_IDENTITIES.items()}
    # a Prometheus scraper's, outside compose: it reads every admin port and may call no gRPC method
    identities[MONITOR] = ca.issue_into(MONITOR, folder / MONITOR)
    api_key = secrets.token_urlsafe(24)
    for path in (folder / "router" / API_KEYS_FILE, folder / "client" / API_KEY_FILE):
        write_secret(path, api_key + "\n")
    return identities
