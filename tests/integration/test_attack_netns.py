"""An attacker on the front link gets nothing; one on the fabric reads pool memory (issue 19).

Three network namespaces joined by veths: the cluster's host, with a front
link (HTTP and gRPC listen there) and a fabric link (the transfer engines
listen there); an attacker on each link. The cluster is ``kvpool up --secure
--api-keys-file``, run in its namespace. The host drops fabric-address packets that
arrive on its front interface, as docs/security.md asks of a deployment
(Linux takes a packet for any of its addresses on any interface), and the
front attacker routes the fabric through the host anyway. The fabric
attacker's successful read shows the test can fail, and why the fabric must
be isolated.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
FRONT, FABRIC = "10.231.1", "10.231.2"
ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass(slots=True)
class Net:
    cluster: str
    front: str
    fabric: str


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    if os.geteuid() == 0 and missing and os.environ.get("CI") and os.environ.get("KVPOOL_TEST_TOOLS") != "0":
        # CI runs as root after scripts/setup.sh, which installs both: a skip there would hide the break-in tests
        pytest.fail(f"{', '.join(missing)} missing: scripts/setup.sh installs them unless KVPOOL_TEST_TOOLS=0")
    if os.geteuid() != 0 or missing:
        pytest.skip("needs root, ip and iptables for network namespaces")
    tag = f"k{os.getpid() % 100000}"
    n = Net(f"{tag}c", f"{tag}f", f"{tag}b")
    try:
        for ns in (n.cluster, n.front, n.fabric):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        for net_prefix, peer, here, there in ((FRONT, n.front, f"{tag}cf", f"{tag}af"),
                                              (FABRIC, n.fabric, f"{tag}cb", f"{tag}ab")):
            ip("link", "add", here, "netns", n.cluster, "type", "veth", "peer", "name", there, "netns", peer)
            ip("-n", n.cluster, "addr", "add", f"{net_prefix}.1/24", "dev", here)
            ip("-n", peer, "addr", "add", f"{net_prefix}.2/24", "dev", there)
            ip("-n", n.cluster, "link", "set", here, "up")
            ip("-n", peer, "link", "set", there, "up")
        # the front attacker routes the fabric through the host; the host refuses fabric traffic from the front
        ip("-n", n.front, "route", "add", f"{FABRIC}.0/24", "via", f"{FRONT}.1")
        subprocess.run(["ip", "netns", "exec", n.cluster, "iptables", "-A", "INPUT", "-i", f"{tag}cf", "-d",
                        f"{FABRIC}.1", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"],
                       check=True, capture_output=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in (n.cluster, n.front, n.fabric):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"network namespaces unavailable: {exc}")
    try:
        yield n
    finally:
        for ns in (n.cluster, n.front, n.fabric):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # the veths go with them


def in_ns(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


@pytest.fixture(scope="module")
def cluster(net: Net, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    workdir = tmp_path_factory.mktemp("attack")
    config = workdir / "cluster.toml"
    config.write_text("".join(f'[{role}]\ntransfer_host = "{FABRIC}.1"\n' for role in ("store", "prefill", "decode")))
    keys = workdir / "api_keys"  # keys in a file: none on a command line
    keys.write_text(f"alice={ALICE}\nbob={BOB}\n")
    proc = subprocess.Popen(
        in_ns(net.cluster, sys.executable, "-m", "kvpool.services.cli", "up", "--host", f"{FRONT}.1", "--stages", "1",
              "--stores", "1", "--segment-size", "32MiB", "--device-cache-tokens", "2048", "--http-port", "0",
              "--grpc-port", "0", "--secure", "--api-keys-file", str(keys), "--config", str(config),
              # engines on the fabric, as a multi-host cluster runs them (one host alone needs none)
              "--transfer-engine", "--workdir", str(workdir / "up")),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops the cluster" in line:
                break
        else:
            pytest.fail("kvpool up ended before serving:\n" + "".join(lines))
        yield workdir / "up"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def attack(ns: str, **action: Any) -> dict[str, Any]:
    out = subprocess.run(in_ns(ns, sys.executable, "-m", "tests.integration.netns_attacker", json.dumps(action)),
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    result = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not result:  # the attacker died trying (the engine aborts on some failures): it got nothing
        assert out.returncode != 0, out.stdout + out.stderr
        return {"died": out.returncode, "read": False, "tail": out.stderr[-500:]}
    return json.loads(result[-1].removeprefix("RESULT "))


def ready(workdir: Path) -> dict[str, dict[str, Any]]:
    return {f.name.removesuffix(".ready.json"): json.loads(f.read_text()) for f in workdir.glob("*.ready.json")}


def engine_ports(net: Net) -> list[int]:
    out = subprocess.run(in_ns(net.cluster, "ss", "-ltnH"), capture_output=True, text=True, check=True).stdout
    locals_ = [line.split()[3] for line in out.splitlines()]
    assert not [a for a in locals_ if a.rsplit(":", 1)[0] in ("0.0.0.0", "*", "[::]")], locals_
    return sorted({int(a.rsplit(":", 1)[1]) for a in locals_ if FABRIC in a})


def test_the_front_link_reaches_no_transfer_port_and_the_fabric_reaches_them_all(net: Net, cluster: Path) -> None:
    ports = engine_ports(net)
    assert len(ports) >= 6  # store, stage and decode engines: a handshake and a transport port each
    front = attack(net.front, action="connect", targets=[[h, p] for p in ports for h in (f"{FABRIC}.1", f"{FRONT}.1")])
    assert front == {"tried": 2 * len(ports), "opened": []}
    fabric = attack(net.fabric, action="connect", targets=[[f"{FABRIC}.1", p] for p in ports])
    assert len(fabric["opened"]) == len(ports)


def test_no_grpc_method_answers_without_a_certificate(net: Net, cluster: Path) -> None:
    services = ready(cluster)
    grpc_ports = sorted(int(r["port"]) for r in services.values())
    result = attack(net.front, action="grpc_plain", ports=grpc_ports, host=f"{FRONT}.1",
                    master_port=int(services["master"]["port"]), ca=str(cluster / "certs" / "ca.pem"))
    assert result == {"tried": len(grpc_ports), "answered": [], "unmount": ["UNAVAILABLE", "UNAVAILABLE"]}


def ask(net: Net, cluster: Path, key: str, pin: str, session: str) -> dict[str, Any]:
    """A completion from the front link whose first chunk holds a PIN; two full chunks."""
    url = f"http://{FRONT}.1:{ready(cluster)['router']['http_port']}/v1/completions"
    body = {"model": "tiny", "prompt": f"My PIN is {pin}. " + "Keep it safe. " * 40, "max_tokens": 1,
            "temperature": 0, "prompt_cache_key": session}
    return attack(net.front, action="http", url=url, key=key, body=body)


def test_no_completion_without_a_key_and_no_other_tenants_prompt(net: Net, cluster: Path) -> None:
    assert ask(net, cluster, "", "4821", "anon")["status"] == 401
    assert ask(net, cluster, "sk-guess-000000000", "4821", "anon")["status"] == 401
    assert ask(net, cluster, ALICE, "4821", "alice-1") == {"status": 200, "cached_tokens": 0}
    guesses = [ask(net, cluster, BOB, pin, f"bob-{pin}")["cached_tokens"] for pin in ("1111", "4821", "9999")]
    assert guesses == [0, 0, 0]
    assert ask(net, cluster, ALICE, "4821", "alice-2") == {"status": 200, "cached_tokens": 512}


def test_only_the_fabric_reads_pool_memory(net: Net, cluster: Path) -> None:
    assert ask(net, cluster, ALICE, "7777", "alice-pool")["status"] == 200  # its two chunks go to the pool
    store = ready(cluster)["store0"]
    target = {"endpoint": store["endpoint"], "address": int(store["segment_address"]), "size": 1 << 16}
    assert store["endpoint"].startswith(f"{FABRIC}.1:")
    front = attack(net.front, action="read", local_host=f"{FRONT}.2", **target)
    assert front["read"] is False
    for _ in range(10):  # the save is write-through, off the request's path: until it has landed
        fabric = attack(net.fabric, action="read", local_host=f"{FABRIC}.2", **target)
        assert fabric["read"] is True, fabric
        if fabric["nonzero"]:
            break
    # the engine checks nothing: anyone on the fabric reads what the pool holds
    assert fabric["nonzero"] > 0
