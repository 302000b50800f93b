"""kvpool up supervises its children: a killed process comes back on its ports, counted in /health.

The whole command runs as a user runs it; the test kills children with
SIGKILL by the pid in their ready files and reads the router's /health.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]


def ready(workdir: Path, name: str) -> dict:
    return json.loads((workdir / f"{name}.ready.json").read_text())


async def test_kvpool_up_restarts_a_killed_master_and_stage_and_shows_it(tmp_path: Path) -> None:
    workdir = tmp_path / "logs"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--stages", "2", "--stores", "1", "--http-port", "0",
         "--grpc-port", "0", "--device-cache-tokens", "4096", "--segment-size", "64MiB", "--workdir", str(workdir)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        assert up.stdout is not None
        for line in up.stdout:
            lines.append(line)
            if "Ctrl-C stops the cluster" in line:
                break
        assert any("a process that dies is restarted" in line for line in lines), "".join(lines)
        url = f"http://127.0.0.1:{ready(workdir, 'router')['http_port']}"
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            body = (await client.get("/health")).json()
            assert body["supervisor"]["services"]["master"] == {
                "restarts": 0, "gave_up": False, "restart_due": False, "alive": True}

            master, stage1 = ready(workdir, "master"), ready(workdir, "p0-stage1")
            os.kill(master["pid"], signal.SIGKILL)
            os.kill(stage1["pid"], signal.SIGKILL)

            async def both_back() -> bool:
                services = (await client.get("/health")).json()["supervisor"]["services"]
                return all(services[n]["restarts"] == 1 and services[n]["alive"] for n in ("master", "p0-stage1"))

            await eventually(both_back, timeout_s=90, what="master and p0-stage1 restarted")
            # the same ports: peers find them where they were
            assert ready(workdir, "master")["port"] == master["port"]
            assert ready(workdir, "p0-stage1")["port"] == stage1["port"]
            assert ready(workdir, "master")["pid"] != master["pid"]

            async def healthy() -> bool:
                return (await client.get("/health")).status_code == 200

            await eventually(healthy, timeout_s=60, what="the cluster healthy again")
            answer = await client.post("/v1/completions", json={"model": "tiny", "prompt": "def fib(n):",
                                                                 "max_tokens": 4, "temperature": 0})
            assert answer.status_code == 200, answer.text
    finally:
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=60)
    assert up.returncode == 0
    assert "master exited with -9; restarting in" in "".join(lines) + out
