"""Operations on a running ``kvpool up``, as an operator meets them, on one cluster:

- a killed master and a killed later prefill stage come back on their ports
  (the supervisor), counted in the router's /health;
- while a stage is down its pipeline is out of rotation (stage 0 answers
  health for the whole pipeline);
- the restarted stage lost its device KV: the first request that would use a
  device hit on that pipeline is refused by that stage, stage 0 forgets its
  cached chunks and plans the request again (pool or compute): every answer
  equals the one before the crash;
- a decode shard that gets SIGTERM mid-stream finishes the stream (drain);
- SIGHUP restarts every service one at a time under load, the router last
  (handed over to a second router on its ports before it drains), with no
  failed request and no changed answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from kvpool.rpc import decode_pb2, decode_pb2_grpc

from tests.integration.conftest import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = {f"s{i}": " ".join(f"def step_{i}_{j}(x): return x * {j} + {i}" for j in range(22)) for i in range(3)}


class Up:
    """``kvpool up`` as a user runs it; a thread collects what it prints."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        config = workdir / "cluster.toml"
        config.write_text("[router]\nhealth_interval_s = 0.2\n")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.services.cli", "up", "--config", str(config), "--pipelines", "2", "--stages", "2",
             "--decode-shards", "2", "--stores", "1", "--segment-size", "64MiB", "--http-port", "0",
             "--grpc-port", "0", "--device-cache-tokens", "4096", "--workdir", str(workdir / "logs")],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.wait_for("Ctrl-C stops the cluster", timeout_s=300)
        self.url = f"http://127.0.0.1:{self.ready('router')['http_port']}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def printed(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.printed(text):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, f"kvpool up never printed {text!r}:\n" + "".join(self.lines)
            time.sleep(0.1)  # polling what a child prints

    def ready(self, name: str) -> dict:
        return json.loads((self.workdir / "logs" / f"{name}.ready.json").read_text())

    def log(self, name: str) -> str:
        return (self.workdir / "logs" / f"{name}.log").read_text()

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        self._reader.join(timeout=10)
        return "".join(self.lines)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    cluster = Up(tmp_path_factory.mktemp("operations"))
    try:
        yield cluster
    finally:
        if cluster.proc.poll() is None:
            cluster.stop()


async def complete(client: httpx.AsyncClient, session: str, max_tokens: int = 6) -> dict:
    response = await client.post("/v1/completions", json={
        "model": "tiny", "prompt": PROMPTS[session], "max_tokens": max_tokens, "temperature": 0,
        "prompt_cache_key": session})
    assert response.status_code == 200, response.text
    return dict(response.json())


async def health(client: httpx.AsyncClient) -> dict:
    return dict((await client.get("/health")).json())


async def test_operations(up: Up) -> None:
    p0 = f"127.0.0.1:{up.ready('p0-stage0')['port']}"
    async with httpx.AsyncClient(base_url=up.url, timeout=120) as client:
        expected = {s: (await complete(client, s))["choices"][0]["text"] for s in PROMPTS}
        body = await health(client)
        assert body["supervisor"]["services"]["master"] == {
            "restarts": 0, "gave_up": False, "restart_due": False, "alive": True}

        # -- a killed master and a killed later stage come back, counted --------------------------
        master, stage1 = up.ready("master"), up.ready("p0-stage1")
        os.kill(master["pid"], signal.SIGKILL)
        os.kill(stage1["pid"], signal.SIGKILL)

        async def p0_out() -> bool:
            return (await health(client))["targets"].get(p0) is False

        await eventually(p0_out, timeout_s=30, what="p0 out of rotation while its stage 1 is down")

        async def both_back() -> bool:
            services = (await health(client))["supervisor"]["services"]
            return all(services[n]["restarts"] == 1 and services[n]["alive"] for n in ("master", "p0-stage1"))

        await eventually(both_back, timeout_s=120, what="master and p0-stage1 restarted")
        assert up.ready("master")["port"] == master["port"] and up.ready("master")["pid"] != master["pid"]
        assert up.ready("p0-stage1")["port"] == stage1["port"]

        async def all_healthy() -> bool:
            return (await client.get("/health")).status_code == 200

        await eventually(all_healthy, timeout_s=60, what="every backend healthy again")
        # no answer changes; the session on p0 lost its device hit and was served anyway
        for s in PROMPTS:
            assert (await complete(client, s))["choices"][0]["text"] == expected[s], s
        assert "device_cache_dropped" in up.log("p0-stage0")

        # -- a decode shard told to stop mid-stream finishes the stream -----------------------------
        async with client.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": "a long answer please", "max_tokens": 300, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}) as stream:
            assert stream.status_code == 200
            signalled, events = False, []
            async for line in stream.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if not signalled and events[-1].get("choices"):
                    # the shard with pages in use is the one streaming to us (once decode has started)
                    busy = [n for n in ("decode0", "decode1") if pages_used(up.ready(n)["port"])]
                    if busy:
                        os.kill(up.ready(busy[0])["pid"], signal.SIGTERM)
                        signalled = True
        assert signalled and "error" not in events[-1]
        usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
        assert usage["completion_tokens"] == 300

        # -- SIGHUP: everything restarts, one at a time, under load; the router is handed over ----
        router_before = up.ready("router")
        up.proc.send_signal(signal.SIGHUP)
        failures: list[str] = []
        served = 0
        deadline = time.monotonic() + 300
        while not up.printed("rolling restart done") and time.monotonic() < deadline:
            for s in PROMPTS:
                try:
                    answer = (await complete(client, s))["choices"][0]["text"]
                except (AssertionError, httpx.HTTPError) as exc:
                    failures.append(f"{s}: {str(exc)[:300]}")
                    continue
                served += 1
                if answer != expected[s]:
                    failures.append(f"{s}: {answer!r} != {expected[s]!r}")
        assert up.printed("rolling restart done (9 of 9 services)"), "".join(up.lines)
        assert failures == [] and served > 0
        router_after = up.ready("router")
        assert router_after["pid"] != router_before["pid"]  # a new router, on the same ports
        assert (router_after["port"], router_after["http_port"]) == (router_before["port"], router_before["http_port"])
        with pytest.raises(ProcessLookupError):
            os.kill(router_before["pid"], 0)  # the first one drained and exited
        assert (await complete(client, "s0"))["choices"][0]["text"] == expected["s0"]
    out = up.stop()
    assert up.proc.returncode == 0
    assert "master exited with -9; restarting in" in out
    for name in ("master", "store0", "p0-stage1", "p0-stage0", "p1-stage1", "p1-stage0", "decode0", "decode1",
                 "router"):
        assert f"rolling restart: {name}" in out


def pages_used(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stats = decode_pb2_grpc.DecodeStub(channel).Stats(decode_pb2.DecodeStatsRequest(), timeout=5)
        return int(stats.num_pages_used)
