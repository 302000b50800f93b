"""What the docker tests share: docker and docker-compose calls, the image's base, the polls and probes.

Every compose call names the project (``PROJECT``); which compose files it reads is docker-compose's own
``COMPOSE_FILE`` (compose.yaml alone when unset), which ``up`` sets for the cluster it starts."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool import tls

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "kvpooldockertest"
REGISTRY_BASE = "python:3.11-slim-bookworm"
LOCAL_BASE = "kvpool-base:bookworm"
HEALTH_URL = "http://127.0.0.1:8000/health"
LOCK = Path("/tmp") / f"{PROJECT}.lock"


def run(*argv: str, timeout: float = 120, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, \
        f"{' '.join(argv)} (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


def compose(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    return run("docker-compose", "-p", PROJECT, *args, timeout=timeout, env=env)


def figure(name: str, value: str) -> None:
    print(f"\n[docker figure] {name}: {value}", flush=True)


def base_image() -> str:
    """KVPOOL_BASE_IMAGE, else the registry's python image, else the local Debian base (built if absent)."""
    if os.environ.get("KVPOOL_BASE_IMAGE"):
        return os.environ["KVPOOL_BASE_IMAGE"]
    for image in (REGISTRY_BASE, LOCAL_BASE):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0:
            return image
    if subprocess.run(["docker", "pull", REGISTRY_BASE], capture_output=True, timeout=300).returncode == 0:
        return REGISTRY_BASE
    start = time.monotonic()
    out = run(str(ROOT / "scripts" / "build-local-base.sh"), LOCAL_BASE, timeout=1800)
    figure("local base build", f"{time.monotonic() - start:.0f} s; {out.strip()}")
    return LOCAL_BASE


def pip_find_links() -> list[Path]:
    """The folders pip's configuration names in find-links (where a host keeps its CPU torch wheel)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                         capture_output=True, text=True).stdout
    folders = [os.environ.get("PIP_FIND_LINKS", "")]
    folders += [line.split("=", 1)[1].strip("'\"") for line in out.splitlines() if ".find-links=" in line]
    return [Path(p) for f in folders for p in f.split() if p and Path(p).is_dir()]


def stage_build_extra() -> None:
    """What the build stage's pip needs from this host (see deploy/build-extra/README.md)."""
    extra = ROOT / "deploy" / "build-extra"
    (extra / "wheels").mkdir(exist_ok=True)
    for folder in pip_find_links():
        for wheel in folder.glob("torch-2.13.0+cpu-*.whl"):
            target = extra / "wheels" / wheel.name
            if not target.exists():
                shutil.copy2(wheel, target)
    host_ca = Path("/etc/ssl/certs/ca-certificates.crt")
    if host_ca.is_file():
        shutil.copy2(host_ca, extra / "ca-certificates.crt")


def project_objects() -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={PROJECT}"
    found = {}
    for kind, argv in {"containers": ["docker", "ps", "-aq"], "networks": ["docker", "network", "ls", "-q"],
                       "volumes": ["docker", "volume", "ls", "-q"]}.items():
        found[kind] = run(*argv, "--filter", label).split()
    return found


def container(service: str) -> dict[str, Any]:
    cid = compose("ps", "-q", service).strip()
    assert cid, f"no container for {service}"
    return json.loads(run("docker", "inspect", cid))[0]


def health_of_all(services: set[str]) -> dict[str, str | None]:
    return {s: container(s)["State"].get("Health", {}).get("Status") for s in services}


def wait_for(what: str, check: Any, timeout_s: float, state: Any = None) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s`` with ``state()``
    and the cluster's logs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    logs = subprocess.run(["docker-compose", "-p", PROJECT, "logs", "--tail", "15", "--no-color"],
                          capture_output=True, text=True, cwd=ROOT).stdout
    pytest.fail(f"{what}: not after {timeout_s:.0f} s; {state() if state else ''}\n{logs[-6000:]}")


def router_healthy() -> bool:
    try:
        with urllib.request.urlopen(HEALTH_URL, timeout=3) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def admin_samples(credentials: Path, port: int, name: str) -> dict[str, float]:
    """A metric's samples (labels -> value) from an admin port, scraped over mutual TLS as the monitor."""
    import ssl

    monitor = credentials / "monitor"
    context = ssl.create_default_context(cafile=str(monitor / "ca.pem"))
    context.load_cert_chain(str(monitor / "cert.pem"), str(monitor / "key.pem"))
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=context, timeout=10) as page:
        lines = page.read().decode().splitlines()
    return {line[len(name):].rpartition(" ")[0]: float(line.rpartition(" ")[2])
            for line in lines if line.startswith(name + "{")}


def pool_stats(master: str = "127.0.0.1:7601") -> dict[str, Any] | None:
    """The master's Stats (``master``: an address, or etcd://HOST:PORT for the leader announced there)."""
    from kvpool.pool.stats_client import fetch_stats

    try:
        return asyncio.run(fetch_stats(master, timeout_s=3))
    except SystemExit:  # the master is not answering (yet)
        return None


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def identity(folder: Path) -> tls.SecuritySettings:
    return tls.SecuritySettings(ca=str(folder / "ca.pem"), cert=str(folder / "cert.pem"), key=str(folder / "key.pem"))


def secure_channel(port: int, folder: Path) -> grpc.Channel:
    creds = tls.Credentials(*((folder / name).read_bytes() for name in ("ca.pem", "cert.pem", "key.pem")))
    return grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(creds.ca, creds.key, creds.cert))


def health(channel: grpc.Channel) -> str:
    """The health service's answer, or the status code of the call's failure."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    except grpc.RpcError as exc:
        return exc.code().name  # type: ignore[attr-defined, no-any-return]
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@contextmanager
def up(files: list[str], ports: list[int], image: str, credentials: Path) -> Iterator[float]:
    """``docker-compose up -d`` of ``files`` (as COMPOSE_FILE) until the router's /health answers 200; yields
    when ``up`` started. On the way out the containers' logs are saved beside the credentials and the project
    goes ``down`` (a test that passed has already downed it with -v and checked nothing is left)."""
    with open(LOCK, "w") as lock:
        # one cluster at a time on this host: xdist's workers (--dist loadfile) or another checkout would
        # start the next one on the same project and ports
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _up(files, ports, image, credentials)


def _up(files: list[str], ports: list[int], image: str, credentials: Path) -> Iterator[float]:
    taken = [p for p in ports if port_taken(p)]
    assert not taken, f"ports {', '.join(files)}'s services need are taken on this host: {taken}"
    assert not any(project_objects().values()), f"{PROJECT} is already up: docker-compose -p {PROJECT} down -v"
    start = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COMPOSE_FILE", os.pathsep.join(files))
        try:
            compose("up", "-d", timeout=900, env={"KVPOOL_BASE_IMAGE": image})
            wait_for("router /health 200", router_healthy, 600)
            yield start
        finally:
            # what each container said, kept past `down` (printed with -s): the first thing to read on a failure
            saved = credentials.parent / f"compose-logs-{Path(files[-1]).stem}.txt"
            saved.write_text(project_logs())
            figure("container logs", str(saved))
            subprocess.run(["docker-compose", "-p", PROJECT, "down", "-v", "--timeout", "20"], cwd=ROOT,
                           capture_output=True, timeout=300)


def project_logs() -> str:
    """What every container of the project has written (across its restarts), with docker's timestamps."""
    return subprocess.run(["docker-compose", "-p", PROJECT, "logs", "--no-color", "--timestamps"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300).stdout


def down_leaves_nothing(services: set[str], ports: list[int]) -> None:
    """``down -v`` leaves no container, network or volume of the project, no mount of its containers and
    no port held."""
    ids = [container(s)["Id"] for s in services]
    merged = [container(s)["GraphDriver"]["Data"]["MergedDir"] for s in services]
    compose("down", "-v", "--timeout", "20")  # -v: the named volumes (sockets, etcd's data) too
    assert project_objects() == {"containers": [], "networks": [], "volumes": []}
    mounts = Path("/proc/self/mountinfo").read_text()
    assert not [i for i in ids if i in mounts] and not [m for m in merged if m in mounts]
    assert not [p for p in ports if port_taken(p)], "a port is still held after down"
