"""compose.yaml for real: build the image, `kvpool certs` and `docker-compose up -d`,
two turns of one session through the OpenAI API with the cluster's API key, the
master killed by its host PID comes back (restart: on-failure) with the pool, and
`down` leaves nothing of the project. The cluster runs with mutual TLS as
compose.yaml does by default: each container mounts only its own credentials,
read-only; a plaintext gRPC client, a client certificate calling an admin method
and a request without the key are refused.

Opt-in (KVPOOL_DOCKER_TESTS=1): it needs a docker daemon and docker-compose (v1)
and builds an image. Where no registry answers, the base image comes from
scripts/build-local-base.sh. Pip's CPU torch wheel and the host's CA bundle are
staged in deploy/build-extra/ as docs/operations.md shows. The figures (build
time, image size, time from `up` to the first completion) are printed (-s)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool import tls
from kvpool.rpc import pool_pb2, pool_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "kvpooldockertest"
REGISTRY_BASE = "python:3.11-slim-bookworm"
LOCAL_BASE = "kvpool-base:bookworm"
HEALTH_URL = "http://127.0.0.1:8000/health"
# every port compose.yaml's services take (deploy/compose/cluster.toml and the commands)
PORTS = [7601, 9601, 7610, 9610, 7611, 9611, 7700, 7701, 7702, 7703, 9700, 9701, 9702, 9703,
         7800, 9800, 7900, 8000, 9900]
SERVICES = {"master", "store-0", "store-1", "prefill-0", "prefill-1", "prefill-2", "prefill-3", "decode-0", "router"}
# the gRPC port of each service (the rest of PORTS: metrics and the HTTP API)
GRPC_PORTS = {"master": 7601, "store-0": 7610, "store-1": 7611, "prefill-0": 7700, "prefill-1": 7701,
              "prefill-2": 7702, "prefill-3": 7703, "decode-0": 7800, "router": 7900}

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(os.environ.get("KVPOOL_DOCKER_TESTS") != "1",
                       reason="builds an image and runs the cluster in docker: set KVPOOL_DOCKER_TESTS=1"),
    pytest.mark.timeout(3600),
]


def run(*argv: str, timeout: float = 120, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"{' '.join(argv)} (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
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


def health_of_all() -> dict[str, str | None]:
    return {s: container(s)["State"].get("Health", {}).get("Status") for s in SERVICES}


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


def pool_stats() -> dict[str, Any] | None:
    from kvpool.pool.stats_client import fetch_stats

    try:
        return asyncio.run(fetch_stats("127.0.0.1:7601", timeout_s=3))
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


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`kvpool certs` into a folder of the test's (compose.yaml mounts it through KVPOOL_TLS_DIR); the test
    process dials as the master, the role pool stats needs."""
    folder = tmp_path_factory.mktemp("compose-tls")
    run(sys.executable, "-m", "kvpool.services.cli", "certs", str(folder))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVPOOL_TLS_DIR", str(folder))
        tls.configure(identity(folder / "master"))
        try:
            yield folder
        finally:
            tls.configure(tls.SecuritySettings(ca="", cert="", key=""))


@pytest.fixture(scope="module")
def image() -> str:
    for tool in ("docker", "docker-compose"):
        assert shutil.which(tool), f"{tool} is not installed (KVPOOL_DOCKER_TESTS=1 asks for this test)"
    run("docker", "info")  # the daemon answers
    base = base_image()
    stage_build_extra()
    start = time.monotonic()
    compose("build", timeout=3600, env={"KVPOOL_BASE_IMAGE": base})
    size = int(run("docker", "image", "inspect", "--format", "{{.Size}}", "kvpool").strip())
    base_size = int(run("docker", "image", "inspect", "--format", "{{.Size}}", base).strip())
    figure("image build", f"{time.monotonic() - start:.0f} s on {base}; image {size / 1e6:.0f} MB, "
           f"base {base_size / 1e6:.0f} MB, the venv layer and apt libraries {(size - base_size) / 1e6:.0f} MB")
    return base


@pytest.fixture(scope="module")
def cluster(image: str, credentials: Path) -> Iterator[dict[str, Any]]:
    taken = [p for p in PORTS if port_taken(p)]
    assert not taken, f"ports compose.yaml's services need are taken on this host: {taken}"
    assert not any(project_objects().values()), f"{PROJECT} is already up: docker-compose -p {PROJECT} down"
    start = time.monotonic()
    try:
        compose("up", "-d", timeout=900, env={"KVPOOL_BASE_IMAGE": image})
        wait_for("router /health 200", router_healthy, 600)
        yield {"up_start": start, "credentials": credentials}
    finally:
        # what each container said, kept past `down` (printed with -s): the first thing to read on a failure
        logs = subprocess.run(["docker-compose", "-p", PROJECT, "logs", "--no-color", "--timestamps"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300).stdout
        saved = credentials.parent / "compose-logs.txt"
        saved.write_text(logs)
        figure("container logs", str(saved))
        subprocess.run(["docker-compose", "-p", PROJECT, "down", "--timeout", "20"], cwd=ROOT,
                       capture_output=True, timeout=300)


def test_compose_up_serves_restarts_and_leaves_nothing(cluster: dict[str, Any]) -> None:
    import openai

    credentials: Path = cluster["credentials"]
    # every role runs in its own container, each reported healthy by its own check (the
    # router's may lag its /health by one interval: nothing waits on it)
    wait_for("every container healthy", lambda: health_of_all() == dict.fromkeys(SERVICES, "healthy"), 180,
             health_of_all)
    # when each container started (depends_on starts it once what it needs is healthy), from the first
    started = {s: datetime.fromisoformat(container(s)["State"]["StartedAt"][:26].rstrip("Z")) for s in SERVICES}
    first_start = min(started.values())
    figure("container starts", ", ".join(f"{s} +{(t - first_start).total_seconds():.0f} s"
                                          for s, t in sorted(started.items(), key=lambda kv: kv[1])))

    api_key = (credentials / "client" / "api_key").read_text().strip()
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=api_key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    session = "docker-session"
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a coding agent. " + "Repository notes: src/ holds the code. " * 30},
        {"role": "user", "content": "List the files in src/."},
    ]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                           extra_body={"prompt_cache_key": session})
    figure("up to first completion", f"{time.monotonic() - cluster['up_start']:.0f} s (load average "
           f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})")
    assert first.usage is not None and first.usage.prompt_tokens > 512
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Tool output: main.py util.py. Open main.py."}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                            extra_body={"prompt_cache_key": session})
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens
    # the first turn's whole chunks (256 tokens each) are served from cache, not recomputed
    whole_chunks = first.usage.prompt_tokens // 256 * 256
    assert second.usage.prompt_tokens_details.cached_tokens >= whole_chunks, second.usage
    # one host: the stages hand off into decode's arena through the shared socket volume, not the engine
    handoff = admin_samples(credentials, 9700, "kvpool_prefill_handoff_bytes_total")
    assert handoff.get('{path="memory"}', 0) > 0 and handoff.get('{path="engine"}', 0) == 0, handoff

    check_credentials_are_required(credentials, model)

    # the pool holds the turns' chunks (saved off the request path: wait until no put is in flight)
    before = wait_for("pool holds the session", lambda: (s := pool_stats()) and len(s["segments"]) == 2
                      and int(s["num_puts_in_flight"]) == 0 and int(s["num_complete_groups"]) > 0 and s, 60)

    # a crash, not a stop: SIGKILL to the master's process by its host PID
    master = container("master")
    old_pid, old_restarts = master["State"]["Pid"], master["RestartCount"]
    os.kill(old_pid, signal.SIGKILL)
    restarted = wait_for("master restarted by docker", lambda: (
        (c := container("master"))["RestartCount"] == old_restarts + 1 and c["State"]["Running"]
        and c["State"]["Pid"] != old_pid and c), 120)
    assert restarted["State"]["Pid"] != old_pid

    # the pool recovers: both stores mount again and re-report what they hold
    after = wait_for("pool recovered", lambda: (s := pool_stats()) and len(s["segments"]) == 2
                     and int(s["num_complete_groups"]) == int(before["num_complete_groups"]) and s, 120)
    assert after["master_incarnation"] != before["master_incarnation"]
    assert int(after["num_objects"]) == int(before["num_objects"])
    wait_for("master healthy again", lambda: health_of_all()["master"] == "healthy", 180, health_of_all)
    # and serves the session's next turn
    messages += [{"role": "assistant", "content": second.choices[0].message.content or ""},
                 {"role": "user", "content": "Now run the tests."}]
    third = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                           extra_body={"prompt_cache_key": session})
    assert third.usage is not None and third.usage.prompt_tokens_details.cached_tokens > 0

    # down leaves no container, network or volume of the project, and no mount of its containers
    ids = [container(s)["Id"] for s in SERVICES]
    merged = [container(s)["GraphDriver"]["Data"]["MergedDir"] for s in SERVICES]
    compose("down", "-v", "--timeout", "20")  # -v: the shared-memory socket volume too
    assert project_objects() == {"containers": [], "networks": [], "volumes": []}
    mounts = Path("/proc/self/mountinfo").read_text()
    assert not [i for i in ids if i in mounts] and not [m for m in merged if m in mounts]
    assert not [p for p in PORTS if port_taken(p)], "a port is still held after down"


def check_credentials_are_required(credentials: Path, model: str) -> None:
    """Each container mounts its own credentials only, read-only; the image holds none; every gRPC port
    refuses a plaintext client and serves one with a certificate of the cluster's CA, whose role still
    gates admin methods; the HTTP API refuses a request without the key."""
    import openai

    for service in SERVICES:
        mounts = {m["Destination"]: m for m in container(service)["Mounts"]}
        tls_mount = mounts["/etc/kvpool/tls"]
        assert (tls_mount["Source"], tls_mount["RW"]) == (str(credentials / service), False), tls_mount
    run("docker", "run", "--rm", "--network", "none", "--entrypoint", "/bin/sh", "kvpool", "-c",
        "test ! -e /etc/kvpool")  # nothing of the credentials is built in
    for service, port in GRPC_PORTS.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain:
            assert health(plain) == "UNAVAILABLE", f"{service} answered a plaintext client"
        with secure_channel(port, credentials / "client") as channel:
            assert health(channel) == "SERVING", service
    with secure_channel(GRPC_PORTS["master"], credentials / "client") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pool_pb2_grpc.PoolMasterStub(channel).UnmountSegment(
                pool_pb2.UnmountSegmentRequest(segment_id="store-0"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    keyless = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="not-the-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        keyless.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
