"""``kvpool up``'s secrets on a shared host (issue 35): never on a command line, never in another user's folder,
and keys imply mutual TLS between the services.

Another local user is uid 65534 (``setpriv``), holding no file of the cluster. One small cluster (one
store, one stage, one shard) started with keys from a file and ``KVPOOL_API_KEY``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpAccess, UpSettings, backend_healthy, up_cluster

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
ALICE, BOB, CAROL = "sk-alice-secret-0123456789", "sk-bob-secret-9876543210", "sk-carol-secret-5555555555"
NOBODY = 65534
SETPRIV = shutil.which("setpriv")
as_another_user = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None,
                                     reason="acting as another local user needs root and setpriv")


def kvpool(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.services.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_key_on_the_command_line_is_refused() -> None:
    done = kvpool("up", "--api-key", f"alice={ALICE}", "--http-port", "0")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "/proc/PID/cmdline" in done.stderr
    assert "--api-keys-file" in done.stderr and "KVPOOL_API_KEY" in done.stderr


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every user may create in, as /tmp (pytest's own folders are root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="kvpool-shared-"))
    folder.chmod(0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def plant(folder: Path, names: list[str]) -> None:
    """As uid 65534: ``folder`` made first, mode 0777, with an empty mode-0666 file at each of ``names``."""
    script = f"mkdir -m 0777 {folder}"
    for name in names:
        script += f" && mkdir -p -m 0777 $(dirname {folder / name}) && touch {folder / name} && chmod 0666 "
        script += str(folder / name)
    subprocess.run([SETPRIV, "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", "sh", "-c", script],
                   check=True, timeout=10)
    assert folder.stat().st_uid == NOBODY


@as_another_user
def test_a_workdir_another_user_made_first_is_refused(shared: Path, tmp_path: Path) -> None:
    workdir = shared / "up"
    plant(workdir, ["api_keys", "certs/ca.pem", "certs/router.key", "certs/client.key"])
    keys = tmp_path / "keys"
    keys.write_text(f"alice={ALICE}\n")
    done = kvpool("up", "--workdir", str(workdir), "--api-keys-file", str(keys), "--http-port", "0",
                  "--grpc-port", "0", "--stores", "0", "--stages", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"workdir {workdir} is owned by uid {NOBODY}, not by this user" in done.stdout
    for name in ("api_keys", "certs/ca.pem", "certs/router.key", "certs/client.key"):
        assert (workdir / name).read_bytes() == b"", name  # nothing written into what they hold


@as_another_user
def test_a_certs_folder_another_user_made_first_is_refused(shared: Path) -> None:
    folder = shared / "tls"
    plant(folder, ["ca.pem", "router/api_keys", "client/api_key", "router/key.pem"])
    done = kvpool("certs", str(folder), "--force")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"certs folder {folder} is owned by uid {NOBODY}" in done.stderr
    for name in ("ca.pem", "router/api_keys", "client/api_key", "router/key.pem"):
        assert (folder / name).read_bytes() == b"", name


def test_up_runs_again_on_its_own_workdir(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    settings = UpSettings(stages=1, stores=0, http_port=0, grpc_port=0, device_cache_tokens=2048,
                          api_key=[f"alice={ALICE}"], workdir=str(workdir))
    keys_inodes = []
    for _ in range(2):  # the second run replaces the first's keys and certificates with new files
        with up_cluster(settings) as up:
            assert up.router is not None and up.router.alive
            keys_inodes.append((workdir / "api_keys").stat().st_ino)
    assert keys_inodes[0] != keys_inodes[1]
    assert stat.S_IMODE(workdir.stat().st_mode) == 0o700


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"# the HTTP API's tenants\nalice={ALICE}\nbob={BOB}\n")
    settings = UpSettings(stages=1, stores=1, segment_size="16MiB", http_port=0, grpc_port=0,
                          device_cache_tokens=2048, api_keys_file=str(keys),
                          workdir=str(tmp_path_factory.mktemp("up") / "work"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVPOOL_API_KEY", f"carol={CAROL}")
        up = up_cluster(settings)
    with up:
        yield up


def test_no_key_is_in_any_command_line_and_every_key_is_served(cluster: Cluster) -> None:
    cmdlines = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:  # gone meanwhile
                continue
    pids = {p.proc.pid for p in cluster.services if p.proc is not None}
    assert pids <= cmdlines.keys()
    for pid, cmdline in cmdlines.items():
        for key in (ALICE, BOB, CAROL):
            assert key.encode() not in cmdline, (pid, cmdline)
    # a process forked from the launcher's zygote shows the zygote's command line: its own arguments (what a
    # process started plainly shows) hold no key either
    for proc in cluster.services:
        assert not [a for a in proc.args if any(key in a for key in (ALICE, BOB, CAROL))], proc.name
    for pid in pids:  # nor its environment: $KVPOOL_API_KEY stays with up, the router gets its keys in a file
        assert CAROL.encode() not in Path(f"/proc/{pid}/environ").read_bytes(), pid
    router = cluster.find("router").args
    keys_file = Path(router[router.index("--api-keys-file") + 1])
    assert keys_file.parent == Path(cluster.workdir or "")
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(keys_file.parent.stat().st_mode) == 0o700
    for key in (ALICE, BOB, CAROL):  # the file's and the variable's keys all reached the router
        request = urllib.request.Request(f"{cluster.http_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200


async def health_check(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = (grpc.aio.secure_channel(target, credentials) if credentials is not None
               else grpc.aio.insecure_channel(target))
    async with channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda _: b"",
                                    response_deserializer=lambda raw: raw)
        try:
            await check(None, timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def test_keys_imply_mutual_tls_every_internal_port_refuses_plaintext(cluster: Cluster) -> None:
    access = cluster.access
    assert isinstance(access, UpAccess) and access.secure and access.ca is not None and access.client is not None
    client = grpc.ssl_channel_credentials(access.ca.ca_path.read_bytes(), access.client.key.read_bytes(),
                                          access.client.cert.read_bytes())
    names = [p.name for p in cluster.services]
    assert {"master", "store0", "p0-stage0", "decode0", "router"} <= set(names)
    for name in names:
        target = f"127.0.0.1:{cluster.find(name).ready['port']}"
        assert asyncio.run(health_check(target, None)) == grpc.StatusCode.UNAVAILABLE, name
        # the same port answers a caller with the cluster's client certificate: it is up, and only TLS
        assert asyncio.run(health_check(target, client)) != grpc.StatusCode.UNAVAILABLE, name


def test_up_sees_its_backends_healthy_through_a_keyed_health(cluster: Cluster) -> None:
    # a rolling restart waits on this; /health names its targets only to a caller with a key
    for name in ("p0-stage0", "decode0"):
        assert backend_healthy(cluster, cluster.find(name)), name
