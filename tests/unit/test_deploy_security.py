"""The deploy files run a secure cluster: every systemd unit names its certificate, the example
cluster.toml the CA and the API keys, and a role beyond loopback without them refuses to start."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool import tls
from services import cli
from tests.unit.test_deploy_files import EXAMPLE_CONFIG, INSTALLED_CONFIG, build_settings, unit_commands


def parsed(argv: list[str], config: Path = EXAMPLE_CONFIG) -> object:
    return cli.build_parser().parse_args([str(config) if a == INSTALLED_CONFIG else a for a in argv])


@pytest.mark.parametrize(("name", "argv"), unit_commands())
def test_every_unit_runs_with_its_own_certificate(name: str, argv: list[str]) -> None:
    security = cli._settings(tls.SecuritySettings, "security", parsed(argv))
    unit = name.removesuffix(".service")
    assert (security.ca, security.cert, security.key) == (
        "/etc/kvpool/tls/ca.pem", "/etc/kvpool/tls/%N.pem", "/etc/kvpool/tls/%N.key"), unit
    settings = build_settings(argv)
    tls.refuse_plaintext_off_loopback(security, [settings.host], name)  # credentials given: no refusal
    if argv[0] == "router":
        assert settings.api_keys_file == "/etc/kvpool/api_keys"


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
