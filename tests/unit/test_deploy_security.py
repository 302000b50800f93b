"""The deploy files run a secure cluster: every systemd unit names its certificate, the example
cluster.toml the CA and the API keys, and a role beyond loopback without them refuses to start.
compose.yaml mounts each container's own folder of `kvpool certs` (checked here on the real
command's output) where its cluster.toml's [security] table and the health probe look."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import NameOID

from kvpool import tls
from kvpool.tools.certs import API_KEY_FILE, API_KEYS_FILE, COMPOSE_IDENTITIES, MONITOR
from kvpool.services import cli, cli_parser
from kvpool.services.router.auth import ApiKeys
from tests.unit.test_deploy_files import (
    COMPOSE_CONFIG,
    EXAMPLE_CONFIG,
    INSTALLED_CONFIG,
    ROOT,
    build_settings,
    compose_commands,
    compose_volumes,
    unit_commands,
    UNIT_DIR,
)

MOUNTED_TLS = "/etc/kvpool/tls"


def parsed(argv: list[str], config: Path = EXAMPLE_CONFIG) -> object:
    return cli_parser.build_parser().parse_args([str(config) if a == INSTALLED_CONFIG else a for a in argv])


def load_credentials(unit: str) -> dict[str, str]:
    """A unit's ``LoadCredential=NAME:SOURCE`` lines, by name (a template's, for an instance)."""
    text = (UNIT_DIR / re.sub(r"@[^.]+\.", "@.", unit)).read_text()
    return dict(line.removeprefix("LoadCredential=").split(":", 1) for line in text.splitlines()
                if line.startswith("LoadCredential="))


@pytest.mark.parametrize(("name", "argv"), unit_commands())
def test_every_unit_runs_with_its_own_certificate_as_credentials(name: str, argv: list[str]) -> None:
    # systemd copies each into the unit's own $CREDENTIALS_DIRECTORY (%d), readable by that service alone
    credentials = {"ca.pem": "/etc/kvpool/tls/ca.pem", "cert.pem": "/etc/kvpool/tls/%N.pem",
                   "key.pem": "/etc/kvpool/tls/%N.key"}
    if argv[0] == "router":
        credentials["api_keys"] = "/etc/kvpool/api_keys"
    assert load_credentials(name) == credentials, name
    security = cli._settings(tls.SecuritySettings, "security", parsed(argv))
    assert (security.ca, security.cert, security.key) == ("%d/ca.pem", "%d/cert.pem", "%d/key.pem"), name
    settings = build_settings(argv)
    tls.refuse_plaintext_off_loopback(security, [settings.host], name)  # credentials given: no refusal
    if argv[0] == "router":
        assert settings.api_keys_file == "%d/api_keys"
    # nothing secret is read from a path the unit's user could be given by another
    assert not [a for a in argv if a.endswith((".key", "api_keys")) and not a.startswith("%d/")], argv


def test_beyond_loopback_without_credentials_a_role_refuses_unless_insecure(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text(EXAMPLE_CONFIG.read_text().split("[security]")[0])
    argv = ["master", "--config", str(config)]
    args = parsed(argv, config)
    with pytest.raises(SystemExit, match="0.0.0.0 without TLS credentials"):
        cli._secure(args, build_settings(argv, config))
    args = parsed([*argv, "--insecure"], config)
    cli._secure(args, build_settings(argv, config))  # said so explicitly: starts in plaintext
    router = ["router", "--config", str(config), "--insecure"]
    cli._secure(parsed(router, config), build_settings(router, config))
    with pytest.raises(SystemExit, match="without API keys"):
        no_keys = tmp_path / "nokeys.toml"
        no_keys.write_text(config.read_text().replace('api_keys_file = "/etc/kvpool/api_keys"', ""))
        plain = ["router", "--config", str(no_keys), "--tls-ca", str(no_keys), "--tls-cert", str(no_keys),
                 "--tls-key", str(no_keys)]
        cli._secure(parsed(plain, no_keys), build_settings(plain, no_keys))


@pytest.mark.parametrize(("name", "argv"), compose_commands())
def test_every_compose_service_mounts_its_own_credentials(name: str, argv: list[str]) -> None:
    assert f"${{KVPOOL_TLS_DIR:-./deploy/compose/tls}}/{name}:{MOUNTED_TLS}:ro" in compose_volumes()[name]
    # the table every container reads names the mounted folder's files, as the probe's variables do
    security = cli._settings(tls.SecuritySettings, "security", parsed(argv, COMPOSE_CONFIG))
    files = (f"{MOUNTED_TLS}/ca.pem", f"{MOUNTED_TLS}/cert.pem", f"{MOUNTED_TLS}/key.pem")
    assert (security.ca, security.cert, security.key) == files
    environment = re.search(r"^  environment:\n((?:    .*\n)+)", (ROOT / "compose.yaml").read_text(), re.M)
    assert environment is not None
    assert dict(line.strip().split(": ") for line in environment.group(1).splitlines()) == dict(
        zip(tls.ENV.values(), files, strict=True))
    # kvpool certs gives the folder a certificate naming this service's role (a store's, its segment)
    role = argv[0] if argv[0] != "store" else f"store/{argv[argv.index('--segment-id') + 1]}"
    assert COMPOSE_IDENTITIES[name] == role
    settings = build_settings(argv, COMPOSE_CONFIG)
    if argv[0] == "router":
        assert settings.api_keys_file == f"{MOUNTED_TLS}/{API_KEYS_FILE}"


def common_name(cert: x509.Certificate) -> str:
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def test_kvpool_certs_writes_each_service_its_own_folder(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    assert cli.main(["certs", str(folder), "--host", "10.0.0.7", "--days", "3"]) == 0
    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    identities = {**COMPOSE_IDENTITIES, MONITOR: MONITOR}  # every compose service's, and a scraper's
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == sorted(identities)
    for name, role in identities.items():
        service = folder / name
        assert (service / "ca.pem").read_bytes() == (folder / "ca.pem").read_bytes()
        cert = x509.load_pem_x509_certificate((service / "cert.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        assert common_name(cert) == role
        assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == 3  # 3 days and the 5 min of skew
        hosts = {str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value}
        assert hosts == {"127.0.0.1", "::1", "localhost", "10.0.0.7"}
        key = service / "key.pem"
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        private = load_pem_private_key(key.read_bytes(), None)
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        assert private.public_key().public_numbers() == cert.public_key().public_numbers()
    # one API key: the router's keys file accepts exactly what the client's folder holds
    keys_file, key_file = folder / "router" / API_KEYS_FILE, folder / "client" / API_KEY_FILE
    assert {stat.S_IMODE(p.stat().st_mode) for p in (keys_file, key_file)} == {0o600}
    keys = ApiKeys.load(str(keys_file), environ={})
    assert keys.tenant_of(key_file.read_text().strip()) == "default"
    assert keys.tenant_of("not-the-key") is None
    # a second run would replace what a running cluster uses: only with --force, and then all of it
    with pytest.raises(SystemExit, match="already holds credentials"):
        cli.main(["certs", str(folder)])
    old_ca = (folder / "ca.pem").read_bytes()
    assert cli.main(["certs", str(folder), "--force"]) == 0
    assert (folder / "master" / "ca.pem").read_bytes() == (folder / "ca.pem").read_bytes() != old_ca
