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

import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvpool.rpc import pool_pb2, pool_pb2_grpc
from tests.docker.support import (
    admin_samples,
    container,
    down_leaves_nothing,
    figure,
    health,
    health_of_all as health_of,
    pool_stats,
    run,
    secure_channel,
    up,
    wait_for,
)

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


def health_of_all() -> dict[str, str | None]:
    return health_of(SERVICES)


@pytest.fixture(scope="module")
def cluster(image: str, credentials: Path) -> Iterator[dict[str, Any]]:
    with up(["compose.yaml"], PORTS, image, credentials) as start:
        yield {"up_start": start, "credentials": credentials}


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

    # down leaves no container, network or volume of the project (the shared-memory socket volume
    # too), no mount of its containers and no port held
    down_leaves_nothing(SERVICES, PORTS)


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
