"""The committed protobuf code must match what protos/ generates today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.cluster
def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate_protos.py"), str(tmp_path)],
        capture_output=True, text=True, check=True,
    )
    generated = [Path(line) for line in done.stdout.split()]
    assert generated, "no protos found under protos/"
    for path in generated:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run scripts/generate_protos.py"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run scripts/generate_protos.py"


def test_generated_package_imports_without_path_tricks() -> None:
    from kvpool.rpc import pool_pb2, pool_pb2_grpc

    assert pool_pb2.DESCRIPTOR.package == "kvpool.rpc"
    assert hasattr(pool_pb2_grpc, "PoolMasterStub")
