"""The zygote: forked children look like started ones, exits and signals are exact, it goes with its starter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import bind_shim
from kvpool.tools.cluster import PARENT_PID_ENV, LocalDecode, LocalPool
from kvpool.tools.cluster import zygote as zygote_module
from kvpool.tools.cluster.zygote import ForkedProcess, Zygote

from tests.integration.conftest import wait_for
from tests.integration.test_bindings import WILDCARDS, host_of, listening

pytestmark = pytest.mark.cluster

CHILD = "tests.integration.zygote_child"


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    started = Zygote(dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    yield started
    started.close()


def env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def test_a_child_gets_its_own_argv_env_and_log_and_reports_its_exit_code(zygote: Zygote, tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = zygote.spawn(CHILD, ["exit", "3"], env(ZYGOTE_TEST="yes"), str(log))
    assert child.wait(timeout=60) == 3
    assert child.poll() == 3
    said = log.read_text()
    # argv and env are the request's, not the zygote's; torch came imported; Ctrl-C raises as in any Python
    assert f"argv ['exit', '3'] env yes cwd {os.getcwd()} torch True sigint True" in said, said


def test_a_preloaded_module_runs_its_main_once_without_runpys_warning(zygote: Zygote, tmp_path: Path) -> None:
    log = tmp_path / "cli.log"
    assert "kvpool.services.cli" in zygote_module.TORCH
    assert zygote.spawn("kvpool.services.cli", ["health", "--help"], env(), str(log)).wait(timeout=60) == 0
    said = log.read_text()
    assert said.startswith("usage: kvpool health"), said  # nothing before it: no RuntimeWarning from runpy
    assert said.count("usage:") == 1
    assert zygote.spawn("kvpool.services.cli", ["health"], env(), str(tmp_path / "bad.log")).wait(timeout=60) == 2


def test_forked_children_draw_different_random_numbers(zygote: Zygote, tmp_path: Path) -> None:
    logs = [tmp_path / f"child{i}.log" for i in range(2)]
    for log in logs:
        assert zygote.spawn(CHILD, ["exit", "0"], env(), str(log)).wait(timeout=60) == 0
    drawn = [log.read_text().split("random ")[1].split()[0] for log in logs]
    assert drawn[0] != drawn[1], drawn


def test_kill_and_wait_answer_as_popen_does(zygote: Zygote, tmp_path: Path) -> None:
    child = zygote.spawn(CHILD, ["pause", "0"], env(), str(tmp_path / "child.log"))
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    assert child.poll() is None
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM
    child.kill()  # after its exit: reaches nobody, raises nothing
    assert child.returncode == -signal.SIGTERM


def test_the_zygote_runs_one_thread_and_is_every_childs_parent(zygote: Zygote, tmp_path: Path) -> None:
    assert len(os.listdir(f"/proc/{zygote.proc.pid}/task")) == 1
    child = zygote.spawn(CHILD, ["pause", "0"], env(), str(tmp_path / "child.log"))
    try:
        stat = Path(f"/proc/{child.pid}/stat").read_text()
        assert int(stat.rsplit(")", 1)[1].split()[1]) == zygote.proc.pid
    finally:
        child.kill()
        child.wait(timeout=60)


def test_a_service_asked_to_die_with_its_parent_goes_with_the_zygote(tmp_path: Path) -> None:
    own = Zygote(dict(os.environ))
    ready = tmp_path / "master.ready.json"
    master = own.spawn("kvpool.services.cli", ["master", "--port", "0", "--admin-port", "0", "--ready-file", str(ready)],
                       dict(os.environ, **{PARENT_PID_ENV: str(own.proc.pid)}), str(tmp_path / "master.log"))
    wait_for(ready.exists, timeout_s=120, what="the master ready")
    own.close()  # as when the launcher exits
    assert own.proc.returncode == 0

    def master_gone() -> bool:
        return master.poll() is not None

    wait_for(master_gone, timeout_s=60, what="the master gone with its zygote")
    assert master.wait(timeout=1) is not None


def test_a_child_that_needs_another_preload_gets_another_zygote(tmp_path: Path) -> None:
    """The bind shim built after the zygote started: a child preloading it must not be forked from a zygote
    without it (its own check would find the shim asked for and not loaded, and refuse to start)."""
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    plain = zygote_module.zygote(base)
    assert plain is not None and zygote_module.zygote(dict(base)) is plain
    shim = bind_shim.build()
    preloaded = zygote_module.zygote({**base, "LD_PRELOAD": str(shim)})
    assert preloaded is not None and preloaded is not plain and plain.alive
    child = preloaded.spawn(CHILD, ["pause", "0"], env(), str(tmp_path / "child.log"))
    try:
        assert str(shim) in Path(f"/proc/{child.pid}/maps").read_text()
    finally:
        child.kill()
        child.wait(timeout=60)


def test_torch_roles_are_forked_and_their_transfer_engine_binds_the_transfer_host(tmp_path: Path) -> None:
    with LocalDecode(workdir=tmp_path) as shard:
        proc = shard.process.proc
        assert isinstance(proc, ForkedProcess)
        # still the zygote's image: it did not exec itself again to get the shim
        assert b"zygote_server" in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        sockets = listening({proc.pid})
        assert len(sockets) >= 3, sockets  # gRPC, metrics and the transfer engine at least
        assert all(host_of(local) not in WILDCARDS for _, local, _ in sockets), sockets


def test_the_other_roles_are_forked_from_a_zygote_without_torch(tmp_path: Path) -> None:
    """A master and its stores fork from the light zygote: torch is never mapped, and a store's transfer
    engine still binds only the transfer host (the shim is preloaded there too)."""
    with LocalPool(num_stores=1, segment_size="16MiB", workdir=tmp_path) as pool:
        procs = [pool.master.proc, pool.stores[0].proc]
        for proc in procs:
            assert isinstance(proc, ForkedProcess)
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            assert "libtorch" not in maps
        assert str(bind_shim.find()) in Path(f"/proc/{procs[1].pid}/maps").read_text()
        sockets = listening({procs[1].pid})
        assert len(sockets) >= 2, sockets  # gRPC and the transfer engine at least
        assert all(host_of(local) not in WILDCARDS for _, local, _ in sockets), sockets


def test_a_master_and_a_store_share_one_zygote_and_the_master_is_not_rebound(tmp_path: Path) -> None:
    """One light zygote per launcher: the master's comes preloaded with the shim (for the stores), which
    leaves a process without KVPOOL_BIND_ADDRESS alone: the master listens where its flags say."""
    with LocalPool(num_stores=1, segment_size="16MiB", workdir=tmp_path) as pool:
        master, store = pool.master.proc, pool.stores[0].proc
        assert isinstance(master, ForkedProcess) and isinstance(store, ForkedProcess)
        assert master._zygote is store._zygote
        assert str(bind_shim.find()) in Path(f"/proc/{master.pid}/maps").read_text()
        sockets = {local for _, local, _ in listening({master.pid})}
        assert any(local.endswith(f":{pool.master.ready['port']}") for local in sockets), sockets
        # gRPC binds 127.0.0.1 on a dual-stack socket: it shows as the mapped address
        assert all(host_of(local) in ("127.0.0.1", "[::ffff:127.0.0.1]") for local in sockets), sockets
