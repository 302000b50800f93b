"""The systemd units and compose file name real roles, flags and values: every
command parses with the real CLI parser and builds its settings the way the CLI
does (defaults, then the file mounted or installed as /etc/kvpool/cluster.toml:
deploy/cluster.toml for the units, deploy/compose/cluster.toml for compose.yaml;
then flags), so a value that fails validation fails here.
test_deploy_tools.py checks the same files with systemd-analyze and docker-compose."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from kvpool.services import cli, cli_parser
from kvpool.services.decode.settings import DecodeSettings
from kvpool.services.master.settings import MasterSettings
from kvpool.services.prefill.settings import PrefillSettings
from kvpool.services.router.settings import RouterSettings
from kvpool.services.store.settings import StoreSettings

ROOT = Path(__file__).resolve().parents[2]
UNIT_DIR = ROOT / "deploy" / "systemd"
EXAMPLE_CONFIG = ROOT / "deploy" / "cluster.toml"
COMPOSE_CONFIG = ROOT / "deploy" / "compose" / "cluster.toml"
INSTALLED_CONFIG = "/etc/kvpool/cluster.toml"
KVPOOL = "/opt/kvpool/.venv/bin/kvpool"  # the Dockerfile's layout: the venv at /opt/kvpool/.venv
NUMACTL = "/usr/bin/numactl"
# the instances each template is started as; prefill @1 and @2 also need a
# next_stage drop-in (see deploy/cluster.toml), so @0 and @3 stand for them
INSTANCES = {"kvpool-store@.service": ["0", "1"], "kvpool-prefill@.service": ["0", "3"],
             "kvpool-decode@.service": ["0", "1"]}
# the settings class and TOML table of each role, as services/cli.py's ROLES names them
ROLES: dict[str, type] = {"master": MasterSettings, "store": StoreSettings, "prefill": PrefillSettings,
                          "decode": DecodeSettings, "router": RouterSettings}


def exec_start(text: str) -> list[str]:
    lines = [line.removeprefix("ExecStart=") for line in text.splitlines() if line.startswith("ExecStart=")]
    assert len(lines) == 1, "one ExecStart per unit"
    return shlex.split(lines[0])


def kvpool_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(numactl options, kvpool arguments) of an ExecStart command line."""
    wrapper: list[str] = []
    if argv[0] == NUMACTL:
        assert KVPOOL in argv, argv
        wrapper, argv = argv[1:argv.index(KVPOOL)], argv[argv.index(KVPOOL):]
    assert argv[0] == KVPOOL, argv
    return wrapper, argv[1:]


def expand(argv: list[str], instance: str) -> list[str]:
    # systemd specifiers: the instance and the host name
    return [a.replace("%i", instance).replace("%H", "host") for a in argv]


def instances(unit: Path) -> list[tuple[str, str]]:
    """(instance unit name, instance) for a template, (unit name, "") otherwise."""
    if "@." not in unit.name:
        return [(unit.name, "")]
    assert unit.name in INSTANCES, f"{unit.name}: say which instances to check"
    return [(unit.name.replace("@.", f"@{i}."), i) for i in INSTANCES[unit.name]]


ETCD_UNIT = "kvpool-etcd.service"  # runs etcd, not kvpool (its own checks below)
ETCD = "/usr/bin/etcd"


def unit_commands(unit_text: dict[str, str] | None = None) -> list[tuple[str, list[str]]]:
    """Every kvpool unit's command (the etcd unit's is etcd's)."""
    texts = unit_text or {u.name: u.read_text() for u in sorted(UNIT_DIR.glob("*.service"))}
    commands = []
    for name, text in texts.items():
        if name == ETCD_UNIT:
            continue
        for instance_name, instance in instances(Path(name)):
            commands.append((instance_name, expand(kvpool_argv(exec_start(text))[1], instance)))
    return commands


def compose_commands(compose_file: str = "compose.yaml") -> list[tuple[str, list[str]]]:
    text = (ROOT / compose_file).read_text()
    return [(m.group(1), json.loads(m.group(2)))
            for m in re.finditer(r"^  ([\w-]+):\n(?:    .*\n)*?    command: (\[[^\]]*\])", text, re.M)]


def build_settings(argv: list[str], config: Path = EXAMPLE_CONFIG) -> Any:
    """Parse ``argv`` and build its settings as ``kvpool <role>`` does, with
    ``config`` in place of the installed or mounted /etc/kvpool/cluster.toml."""
    argv = [str(config) if a == INSTALLED_CONFIG else a for a in argv]
    args = cli_parser.build_parser().parse_args(argv)
    return cli._settings(ROLES[args.command], args.command, args)


def test_every_unit_and_service_has_a_command() -> None:
    assert {name for name, _ in unit_commands()} == {
        "kvpool-master.service", "kvpool-store@0.service", "kvpool-store@1.service",
        "kvpool-prefill@0.service", "kvpool-prefill@3.service", "kvpool-decode@0.service",
        "kvpool-decode@1.service", "kvpool-router.service"}
    assert {name for name, _ in compose_commands()} == {
        "master", "store-0", "store-1", "prefill-0", "prefill-1", "prefill-2", "prefill-3", "decode-0", "router"}


@pytest.mark.parametrize(("name", "argv"), unit_commands())
def test_command_builds_valid_settings(name: str, argv: list[str]) -> None:
    settings = build_settings(argv)
    assert isinstance(settings, ROLES[argv[0]]), name


@pytest.mark.parametrize(("name", "argv"), compose_commands())
def test_compose_command_reads_the_mounted_file(name: str, argv: list[str]) -> None:
    assert argv[1:3] == ["--config", INSTALLED_CONFIG], name
    settings = build_settings(argv, COMPOSE_CONFIG)
    assert isinstance(settings, ROLES[argv[0]]), name


def compose_volumes() -> dict[str, list[str]]:
    """Each service's ``volumes: [...]`` line (a YAML flow list: aliases bare, paths quoted)."""
    text = (ROOT / "compose.yaml").read_text()
    return {m.group(1): [v.strip().strip('"') for v in m.group(2).split(",")]
            for m in re.finditer(r"^  ([\w-]+):\n(?:    .*\n)*?    volumes: \[([^\]]*)\]", text, re.M)}


def test_compose_mounts_its_settings_file() -> None:
    text = (ROOT / "compose.yaml").read_text()
    mount = f"x-settings: &settings ./{COMPOSE_CONFIG.relative_to(ROOT)}:{INSTALLED_CONFIG}:ro"
    assert text.count(mount) == 1, f"compose.yaml should name its settings mount once: {mount}"
    volumes = compose_volumes()
    assert set(volumes) == {name for name, _ in compose_commands()}
    assert all(v[0] == "*settings" for v in volumes.values()), volumes


@pytest.mark.parametrize("instance", INSTANCES["kvpool-store@.service"])
def test_store_unit_binds_the_node_it_serves(instance: str) -> None:
    wrapper, argv = kvpool_argv(exec_start((UNIT_DIR / "kvpool-store@.service").read_text()))
    assert expand(wrapper, instance) == [f"--cpunodebind={instance}", f"--membind={instance}"]
    assert build_settings(expand(argv, instance)).numa_node == int(instance)


@pytest.mark.parametrize("instance", INSTANCES["kvpool-prefill@.service"])
def test_prefill_unit_runs_the_stage_it_names(instance: str) -> None:
    _, argv = kvpool_argv(exec_start((UNIT_DIR / "kvpool-prefill@.service").read_text()))
    assert build_settings(expand(argv, instance)).stage == int(instance)


def test_compose_wiring_matches_the_ports_each_service_takes() -> None:
    settings = {name: build_settings(argv, COMPOSE_CONFIG) for name, argv in compose_commands()}
    stores = [s for name, s in settings.items() if name.startswith("store-")]
    assert len({(s.port, s.admin_port) for s in stores}) == len(stores), "stores on one host need their own ports"
    stages = {s.stage: s for name, s in settings.items() if name.startswith("prefill-")}
    assert stages[0].stage_addresses == [f"127.0.0.1:{stages[i].port}" for i in range(1, len(stages))]
    for i in range(1, len(stages) - 1):
        assert stages[i].next_stage == f"127.0.0.1:{stages[i + 1].port}"
    master = settings["master"]
    assert all(s.master == f"127.0.0.1:{master.port}" for s in [*stores, *stages.values()])
    router, decode = settings["router"], settings["decode-0"]
    assert router.pipelines == [f"127.0.0.1:{stages[0].port}"] and router.shards == [f"127.0.0.1:{decode.port}"]
    ports = [(s.port, s.admin_port) for s in settings.values()]
    assert len({p for pair in ports for p in pair}) == 2 * len(ports), "two services on one port"


@pytest.mark.parametrize("instance", INSTANCES["kvpool-decode@.service"])
def test_decode_unit_listens_on_its_own_port(instance: str) -> None:
    _, argv = kvpool_argv(exec_start((UNIT_DIR / "kvpool-decode@.service").read_text()))
    settings = build_settings(expand(argv, instance))
    assert (settings.port, settings.admin_port) == (7800 + int(instance), 9800 + int(instance))


# The checks above must be able to fail: the same path rejects bad values.
BAD_UNIT = {
    "kvpool-store@.service": ("--numa-node %i", "--numa-node -1", "numa_node: must be >= 0"),
    "kvpool-master.service": ("master --config", "master --high-watermark 0.5 --low-watermark 0.9 --config",
                              "watermarks must satisfy"),
    "kvpool-prefill@.service": ("--stage %i", "--stage 7", "stage: 7 is not in"),
}


@pytest.mark.parametrize("unit", sorted(BAD_UNIT))
def test_a_bad_value_in_a_unit_fails(unit: str) -> None:
    old, new, setting = BAD_UNIT[unit]
    text = (UNIT_DIR / unit).read_text()
    assert old in text
    commands = unit_commands({unit: text.replace(old, new)})
    for name, argv in commands:
        with pytest.raises(SystemExit, match=setting):
            build_settings(argv)


@pytest.mark.parametrize(("argv", "setting"), [
    (["store", "--segment-size", "lots"], "segment_size: 'lots' is not a size"),
    (["master", "--port", "70000"], "port: 70000 is not a TCP port"),
    (["prefill", "--stage", "0"], "stage_addresses"),  # stage 0 of 4 without the others' addresses
    (["prefill", "--stage", "1", "--config", INSTALLED_CONFIG], "next_stage"),  # what the @1 drop-in supplies
    (["router", "--pipelines", "a:1", "--shards", "b:2", "--http-read-timeout-s", "0"], "http_read_timeout_s"),
    (["router", "--pipelines", "a:1", "--shards", "b:2", "--http-read-timeout-s", "inf"], "http_read_timeout_s"),
    (["router", "--pipelines", "a:1", "--shards", "b:2", "--http-max-connections", "0"], "http_max_connections"),
    (["router", "--pipelines", "a:1", "--shards", "b:2", "--grpc-max-concurrent-rpcs", "0"], "grpc_max_concurrent_rpcs"),
    (["router", "--pipelines", "a:1", "--shards", "b:2", "--http-max-connections-per-client", "-1"],
     "http_max_connections_per_client"),
])
def test_a_bad_command_fails(argv: list[str], setting: str) -> None:
    with pytest.raises(SystemExit, match=setting):
        build_settings(argv)


def test_a_bad_value_in_the_config_file_fails(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.toml"
    bad.write_text(EXAMPLE_CONFIG.read_text().replace('segment_size = "768GiB"', 'segment_size = "lots"'))
    assert bad.read_text() != EXAMPLE_CONFIG.read_text()
    args = cli_parser.build_parser().parse_args(["store", "--config", str(bad)])
    with pytest.raises(SystemExit, match="segment_size"):
        cli._settings(StoreSettings, "store", args)


@pytest.mark.parametrize("unit", sorted(p.name for p in UNIT_DIR.glob("*.service")))
def test_every_unit_restarts_a_dead_process_within_a_limit(unit: str) -> None:
    # the same policy as kvpool up's supervisor: restart with a pause, give up after a burst
    text = (UNIT_DIR / unit).read_text()
    unit_section = text.split("[Service]")[0]
    service_section = text.split("[Service]")[1].split("[Install]")[0]
    assert re.search(r"^Restart=on-failure$", service_section, re.M)
    assert re.search(r"^RestartSec=\d+$", service_section, re.M)
    assert re.search(r"^StartLimitIntervalSec=\d+$", unit_section, re.M)
    assert re.search(r"^StartLimitBurst=\d+$", unit_section, re.M)


@pytest.mark.parametrize("unit", sorted(INSTANCES))
def test_units_of_a_host_share_one_private_shared_memory_folder(unit: str) -> None:
    # stores (and decode shards) put their shared-memory sockets there, stages map through them: one folder for
    # every kvpool unit of the host, the kvpool user's alone, not removed while one of them restarts
    text = (UNIT_DIR / unit).read_text()
    for line in ("User=kvpool", "RuntimeDirectory=kvpool", "RuntimeDirectoryMode=0700", "RuntimeDirectoryPreserve=yes"):
        assert line in text.splitlines(), line
    if unit in ("kvpool-store@.service", "kvpool-decode@.service"):  # the two that offer shared memory
        _, argv = kvpool_argv(exec_start(text))
        assert build_settings(expand(argv, "0")).shared_memory_dir == "/run/kvpool"


def test_compose_gives_every_sharing_service_one_private_socket_folder() -> None:
    # stores, stages and decode offer shared memory through sockets in one tmpfs volume, root's alone (0700),
    # mounted where each one's settings look: the stages reach the stores' segments and decode's arena
    text = (ROOT / "compose.yaml").read_text()
    assert "x-run: &run kvpool-run:/run/kvpool" in text
    assert re.search(r"^volumes:\n  kvpool-run:\n    driver: local\n"
                     r"    driver_opts: \{type: tmpfs, device: tmpfs, o: \"mode=0700\"\}\n", text, re.M)
    sharing = {name for name, argv in compose_commands() if argv[0] in ("store", "prefill", "decode")}
    assert sharing and {name for name, volumes in compose_volumes().items() if "*run" in volumes} == sharing
    for name, argv in compose_commands():
        if name in sharing:
            assert build_settings(argv, COMPOSE_CONFIG).shared_memory_dir == "/run/kvpool", name


def etcd_flags() -> set[str]:
    """The flags Debian's etcd takes, as its --help lists them."""
    import shutil
    import subprocess

    if shutil.which("etcd") is None and not Path(ETCD).exists():
        pytest.skip("etcd is not installed (scripts/setup.sh installs etcd-server)")
    done = subprocess.run([shutil.which("etcd") or ETCD, "--help"], capture_output=True, text=True, timeout=30)
    return set(re.findall(r"^\s+(--[a-z0-9-]+)", done.stdout + done.stderr, re.M))


@pytest.mark.cluster  # runs etcd --help
def test_the_etcd_unit_runs_etcd_with_flags_it_knows_over_mutual_tls() -> None:
    argv = exec_start((UNIT_DIR / ETCD_UNIT).read_text())
    assert argv[0] == ETCD
    flags = [a for a in argv[1:] if a.startswith("--")]
    assert set(flags) <= etcd_flags(), set(flags) - etcd_flags()
    values = dict(zip(argv[1::2], argv[2::2]))
    # clients must show a certificate of the cluster's CA: the unit's own credentials
    assert "--client-cert-auth" in argv and values["--trusted-ca-file"] == "%d/ca.pem"
    assert (values["--cert-file"], values["--key-file"]) == ("%d/cert.pem", "%d/key.pem")
    assert values["--listen-client-urls"].startswith("https://") and values["--data-dir"] == "/var/lib/kvpool-etcd"
    assert "StateDirectory=kvpool-etcd" in (UNIT_DIR / ETCD_UNIT).read_text().splitlines()


def test_a_master_unit_can_name_the_etcd_its_standbys_elect_in(tmp_path: Path) -> None:
    # [master] etcd = "...", [store] master = "etcd://...": what docs/operations.md tells a standby's operator
    config = tmp_path / "cluster.toml"
    config.write_text(EXAMPLE_CONFIG.read_text() + "\n")
    _, argv = kvpool_argv(exec_start((UNIT_DIR / "kvpool-master.service").read_text()))
    settings = build_settings([*argv, "--etcd", "10.0.0.9:2379"], config)
    assert settings.etcd == "10.0.0.9:2379" and settings.lease_times().ttl_s == 2.0
    _, store = kvpool_argv(exec_start((UNIT_DIR / "kvpool-store@.service").read_text()))
    store_settings = build_settings([*expand(store, "0"), "--master", "etcd://10.0.0.9:2379"], config)
    assert store_settings.master == "etcd://10.0.0.9:2379"


STANDBY_COMPOSE = "compose.standby.yaml"
STANDBY_CONFIG = ROOT / "deploy" / "compose" / "cluster-standby.toml"


def test_the_standby_compose_file_runs_two_master_candidates_and_stores_that_follow_the_leader() -> None:
    commands = dict(compose_commands(STANDBY_COMPOSE))
    assert set(commands) == {"etcd", "master-standby"}  # the rest are compose.yaml's, with the standby settings
    standby = build_settings(commands["master-standby"], STANDBY_CONFIG)
    assert standby.etcd == "127.0.0.1:2379" and standby.port == 7602
    master = dict(compose_commands())["master"]
    assert build_settings(master, STANDBY_CONFIG).etcd == standby.etcd
    for name in ("store-0", "prefill-0"):
        assert build_settings(dict(compose_commands())[name], STANDBY_CONFIG).master == "etcd://127.0.0.1:2379"
    text = (ROOT / STANDBY_COMPOSE).read_text()
    # every kvpool service of compose.yaml that reaches the master reads the standby settings
    for name in ("master", "store-0", "store-1", "prefill-0", "prefill-1", "prefill-2", "prefill-3"):
        assert re.search(rf"^  {name}:\n    volumes: \[\*standby-settings\]", text, re.M), name


@pytest.mark.cluster  # runs etcd --help
def test_the_standby_compose_etcd_takes_its_flags_over_mutual_tls() -> None:
    argv = dict(compose_commands(STANDBY_COMPOSE))["etcd"]
    flags = {a for a in argv if a.startswith("--")}
    assert flags <= etcd_flags(), flags - etcd_flags()
    assert "--client-cert-auth" in argv and argv[argv.index("--trusted-ca-file") + 1] == "/etc/kvpool/tls/ca.pem"
