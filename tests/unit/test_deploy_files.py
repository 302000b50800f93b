"""The systemd units and compose file name real roles, flags and values."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from kvpool.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def unit_commands() -> list[tuple[str, list[str]]]:
    commands = []
    for unit in sorted((ROOT / "deploy" / "systemd").glob("*.service")):
        for line in unit.read_text().splitlines():
            if line.startswith("ExecStart="):
                argv = shlex.split(line.removeprefix("ExecStart="))
                # systemd specifiers: an instance number and a host name
                argv = [a.replace("%i", "0").replace("%H", "host") for a in argv]
                assert argv[0].endswith("/kvpool"), unit.name
                commands.append((unit.name, argv[1:]))
    return commands


def compose_commands() -> list[tuple[str, list[str]]]:
    text = (ROOT / "compose.yaml").read_text()
    return [(m.group(1), json.loads(m.group(2)))
            for m in re.finditer(r"^  ([\w-]+):\n(?:    .*\n)*?    command: (\[[^\]]*\])", text, re.M)]


def test_every_unit_and_service_has_a_command() -> None:
    assert {name for name, _ in unit_commands()} == {
        "kvpool-master.service", "kvpool-store@.service", "kvpool-prefill@.service"}
    assert {name for name, _ in compose_commands()} == {
        "master", "store-0", "store-1", "prefill-0", "prefill-1", "prefill-2", "prefill-3"}


@pytest.mark.parametrize(("name", "argv"), unit_commands() + compose_commands())
def test_command_parses(name: str, argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.command in {"master", "store", "prefill"}, name
