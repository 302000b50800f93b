"""deploy/ checked by the tools that will read it: `systemd-analyze verify` on
every unit and on instances of the templates, `docker-compose config` on
compose.yaml. Any line either tool prints fails the test, not only a non-zero
exit: systemd ignores a setting it cannot parse with nothing but a warning.
scripts/setup.sh installs docker-compose and numactl; a test skips only where
its tool is absent."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT_DIR = ROOT / "deploy" / "systemd"
UNITS = sorted(p.name for p in UNIT_DIR.glob("*.service"))
# where the units expect kvpool (the Dockerfile's layout); systemd checks that a
# command's binary is executable, so the copies verified here name the kvpool
# this test runs with instead. Everything else, numactl included, is as written.
INSTALLED_KVPOOL = "/opt/kvpool/.venv/bin/kvpool"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
DOCKER_COMPOSE = shutil.which("docker-compose")

needs_systemd = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
needs_compose = pytest.mark.skipif(DOCKER_COMPOSE is None, reason="docker-compose is not installed")


def local_kvpool() -> str:
    path = Path(sys.executable).with_name("kvpool")
    assert path.is_file(), f"{path} missing: scripts/setup.sh installs the project into .venv"
    return str(path)


def names_to_verify(unit: str) -> list[str]:
    """A unit, or a template itself and two of its instances."""
    return [unit, unit.replace("@.", "@0."), unit.replace("@.", "@1.")] if "@." in unit else [unit]


def systemd_verify(texts: dict[str, str], name: str, tmp_path: Path) -> tuple[int, list[str]]:
    """Write ``texts`` (unit file name -> content) to a directory and verify ``name`` there."""
    kvpool = local_kvpool()
    unit_dir = tmp_path / "units"
    unit_dir.mkdir(exist_ok=True)
    for file_name, text in texts.items():
        # every unit runs kvpool, but etcd's (Debian's /usr/bin/etcd, here as there)
        assert INSTALLED_KVPOOL in text or file_name == "kvpool-etcd.service", \
            f"{file_name} no longer runs {INSTALLED_KVPOOL}: update this test"
        (unit_dir / file_name).write_text(text.replace(INSTALLED_KVPOOL, kvpool))
    assert SYSTEMD_ANALYZE is not None
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", str(unit_dir / name)],
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.returncode, lines


def real_units() -> dict[str, str]:
    return {name: (UNIT_DIR / name).read_text() for name in UNITS}


@pytest.mark.cluster
@needs_systemd
@pytest.mark.parametrize("name", [n for unit in UNITS for n in names_to_verify(unit)])
def test_systemd_accepts_unit(name: str, tmp_path: Path) -> None:
    rc, lines = systemd_verify(real_units(), name, tmp_path)
    assert rc == 0 and not lines, f"systemd-analyze verify {name} (exit {rc}):\n" + "\n".join(lines)


def test_every_template_is_verified_as_instances() -> None:
    assert "kvpool-store@.service" in UNITS and "kvpool-prefill@.service" in UNITS
    assert names_to_verify("kvpool-store@.service") == [
        "kvpool-store@.service", "kvpool-store@0.service", "kvpool-store@1.service"]


# The checks above must be able to fail: what they catch, shown on changed copies.
STORE = "kvpool-store@.service"


@pytest.mark.cluster
@needs_systemd
@pytest.mark.parametrize(("change", "expected"), [
    # systemd 252 does not expand %i in NUMAMask= and ignores the line with a warning (exit 0)
    (lambda t: t.replace("[Service]\n", "[Service]\nNUMAPolicy=bind\nNUMAMask=%i\n"),
     "Failed to parse NUMA node mask"),
    # a binary the unit names but the host lacks (numactl before setup.sh installed it)
    (lambda t: t.replace("/usr/bin/numactl ", "/usr/bin/numactl-missing "), "is not executable"),
    (lambda t: t.replace("TimeoutStopSec=15", "TimeoutStopSec=fifteen"), "Failed to parse time value"),
], ids=["numa-mask-specifier", "missing-binary", "bad-value"])
def test_systemd_check_catches(change, expected: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    texts = real_units()
    changed = change(texts[STORE])
    assert changed != texts[STORE]
    rc, lines = systemd_verify({**texts, STORE: changed}, "kvpool-store@0.service", tmp_path)
    assert any(expected in line for line in lines), lines


def compose_config(compose_file: Path, *more: Path) -> subprocess.CompletedProcess[str]:
    assert DOCKER_COMPOSE is not None
    files = [arg for f in (compose_file, *more) for arg in ("-f", str(f))]
    return subprocess.run([DOCKER_COMPOSE, *files, "config", "--quiet"],
                          capture_output=True, text=True, timeout=120, cwd=compose_file.parent)


@pytest.mark.cluster
@needs_compose
def test_docker_compose_accepts_compose_file() -> None:
    done = compose_config(ROOT / "compose.yaml")
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        f"docker-compose config (exit {done.returncode}):\n{done.stdout}{done.stderr}")


@pytest.mark.cluster
@needs_compose
def test_docker_compose_accepts_the_standby_file_over_compose_file() -> None:
    done = compose_config(ROOT / "compose.yaml", ROOT / "compose.standby.yaml")
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        f"docker-compose config (exit {done.returncode}):\n{done.stdout}{done.stderr}")


@pytest.mark.cluster
@needs_compose
def test_docker_compose_check_catches_a_bad_key(tmp_path: Path) -> None:
    text = (ROOT / "compose.yaml").read_text()
    bad = tmp_path / "compose.yaml"
    bad.write_text(text.replace("network_mode: host", "network_mod: host"))
    assert bad.read_text() != text
    done = compose_config(bad)
    assert done.returncode != 0 and "network_mod" in done.stderr, done.stderr
