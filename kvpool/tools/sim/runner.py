"""Run one entry of the matrix: build the topology and settings from a ``RunSpec`` and simulate it.

A module-level function of plain arguments, so a process pool can run the
matrix's entries side by side (each in its own interpreter: no shared state).
The cost model's ``[fit]`` inputs set the device KV per GPU (prefill and
decode) and, unless the settings give one, the think-time scale.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvpool.tools.sim.cost_model import CostModel, load_cost_model
from kvpool.tools.sim.engine import Simulation
from kvpool.tools.sim.report import RunSpec
from kvpool.tools.sim.topology import RunSettings, Topology, affinity_label
from kvpool.workload.weka import Session, load_sessions


@lru_cache(maxsize=2)
def _sessions(trace_dir: str) -> list[Session]:
    """Parsed once per process (seconds for the real folder): a process pool's worker runs many specs."""
    return load_sessions(trace_dir)


def run_spec(spec: RunSpec, trace_dir: str, cost_path: str | CostModel, base: RunSettings,
             topology: Topology) -> dict[str, Any]:
    cost = cost_path if isinstance(cost_path, CostModel) else load_cost_model(Path(cost_path))
    traces = _sessions(trace_dir)
    warmup = base.warmup_s if spec.warmup_s is None else spec.warmup_s
    settings = replace(
        base, num_sessions=spec.sessions_per_server * spec.servers, pool=spec.pool, duration_s=spec.duration_s,
        warmup_s=warmup if warmup < spec.duration_s else spec.duration_s / 2, agent_prefix=spec.agent_prefix,
        fail_server_at_s=spec.fail_at_s,
        affinity_max_queue=base.affinity_max_queue if spec.affinity is None else spec.affinity,
    )
    if spec.max_context is not None:
        topology = replace(topology, max_context=spec.max_context)
    topology = replace(topology, num_servers=spec.servers, device_kv_gib_per_gpu=cost.fit.device_kv_gib_per_gpu,
                       decode_kv_gib_per_gpu=cost.fit.decode_kv_gib_per_gpu or topology.decode_kv_gib_per_gpu)
    result = Simulation(topology, settings, cost, traces).run()
    result.update(label=spec.label, sessions_per_server=spec.sessions_per_server, fail_at_s=spec.fail_at_s,
                  window_s=settings.window_s, reading=spec.reading, seed_sessions=spec.seed_sessions,
                  affinity_label=affinity_label(settings.affinity_max_queue))
    result["cross_server_gbps_per_nic"] = result["cross_server_bytes_per_s_per_nic"] / 1e9
    return result
