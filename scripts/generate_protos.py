"""Regenerate the committed protobuf/gRPC Python code from ``protos/``.

Usage: ``python scripts/generate_protos.py [OUT_ROOT]``. With no argument the
code is written into the source tree (``kvpool/rpc/``); the staleness test
passes a temporary directory and compares bytes. grpcio-tools is pinned in
pyproject.toml so the output is reproducible.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Generate code for every proto under ``protos/`` into ``out_root``."""
    from grpc_tools import protoc  # dev dependency, imported only here

    out_root.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    outputs = []
    for name in files:
        stem = out_root / name.removesuffix(".proto")
        outputs += [stem.with_name(stem.name + sfx) for sfx in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return outputs


def main() -> None:
    out_root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out_root):
        print(path)


if __name__ == "__main__":
    main()
