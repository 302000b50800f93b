"""Protobuf types stay at the edges: only servicers, clients and the server wiring import generated code.

Stage code, the scheduler, the router's request logic and the store's record
keeping take plain domain types; a servicer or client converts messages to and
from them. The edges, by name: the generated package ``kvpool.rpc``;
``servicer``/``*_servicer``; ``server`` and ``kvpool.service``;
``client``/``*_client``/``clients``/``*_clients``. Anything else that is truly an edge is
listed in ``OUTSIDE_CLIENTS`` with its reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.unit.test_layering import imported_modules, modules, parsed

GENERATED = re.compile(r"kvpool\.rpc\.\w+_pb2(_grpc)?|grpc_health\.v1\.health_pb2(_grpc)?|grpc_reflection\..*pb2\w*")
EDGE_MODULES = {
    "kvpool.service",  # the server wiring every service shares
    "kvpool.handoff_messages",  # the handoff's messages, which the router and every stage pass on, converted once
}
EDGE_NAME = re.compile(r"(.*_)?(servicer|client|clients)|server")

# modules that are clients though their names do not say so (a prefix covers its package)
OUTSIDE_CLIENTS = {
    "kvpool.tools.bench": "the benchmarks drive the services over gRPC as outside clients",
    "kvpool.tools.health": "a health probe: a client of any service's stock health servicer",
    "kvpool.services.master.core_bench": "a benchmark: it sends the master's servicer a pool client's messages, "
                                         "in its own process",
}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def is_edge(name: str) -> bool:
    return (_under(name, "kvpool.rpc") or name in EDGE_MODULES
            or EDGE_NAME.fullmatch(name.rpartition(".")[2]) is not None or any(_under(name, prefix) for prefix in OUTSIDE_CLIENTS))


def generated_imports(path: Path, name: str) -> set[str]:
    """The generated modules this file imports; ``from grpc_health.v1 import health_pb2`` names ``health_pb2``
    although it is not one of ours."""
    names = set(imported_modules(path, name))
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if GENERATED.fullmatch(n)}


def offenders(found: dict[str, Path]) -> dict[str, list[str]]:
    """Module → the generated modules it imports, for every module that is not an edge."""
    bad = {name: sorted(generated_imports(path, name)) for name, path in found.items() if not is_edge(name)}
    return {name: imports for name, imports in bad.items() if imports}


def test_only_the_edges_import_generated_code() -> None:
    found = offenders(modules())
    assert found == {}, f"convert to domain types in a servicer or client: {found}"


def test_the_tables_name_real_modules() -> None:
    for prefix in (*OUTSIDE_CLIENTS, *EDGE_MODULES):
        assert any(_under(name, prefix) for name in modules()), prefix


def test_the_check_catches_a_planted_offender(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("from kvpool.rpc import prefill_pb2\nfrom grpc_health.v1 import health_pb2_grpc\n")
    inside = tmp_path / "inside.py"
    inside.write_text("def later():\n    import kvpool.rpc.pool_pb2_grpc as stubs\n")
    clean = tmp_path / "clean.py"
    clean.write_text("from kvpool.core.pool.records import ObjectRecord\nfrom grpc_health.v1 import health\n")
    assert offenders({
        "kvpool.services.prefill.planted": planted,
        "kvpool.services.store.inside": inside,
        "kvpool.services.store.clean": clean,
        "kvpool.services.prefill.stage_servicer": planted,  # a servicer may
        "kvpool.services.router.backend_client": planted,  # a client may
        "kvpool.tools.bench.planted": planted,  # listed with its reason
    }) == {
        "kvpool.services.prefill.planted": ["grpc_health.v1.health_pb2_grpc", "kvpool.rpc.prefill_pb2"],
        "kvpool.services.store.inside": ["kvpool.rpc.pool_pb2_grpc"],
    }
