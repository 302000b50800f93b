"""A run's figures as plain numbers (what ``Simulation.summary`` returns), with each figure's definition.

Throughput, in two readings (tokens of turns whose decode ended after
warm-up, over the counted span, per GPU of every server, prefill and decode):
- ``throughput_per_gpu``: prompt + output tokens, whether the prompt's
  tokens came from the device, the pool or were computed: what the seed most
  plausibly counts (a serving benchmark's "total token throughput", the only
  reading under which 95% reuse and 44K tokens/s per GPU fit one server);
- ``throughput_per_gpu_computed``: computed prompt tokens + output tokens:
  the work the GPUs did.
Decode KV use: filled pages (a sequence's prompt and its tokens decoded so
far) over all pages, sampled every 5 s per shard; ``decode_kv_reserved_p50``
counts the pages the shards hold instead: each turn's pages for its whole
life, from its router ticket (before prefill) to its last token.
"""

from __future__ import annotations

from typing import Any

from kvpool.tools.sim.metrics import percentile, settling, ttft_breakdown


def summarize(sim: Any, wall_s: float) -> dict[str, Any]:
    """``sim``: a finished ``engine.Simulation`` (not imported: the engine imports this module)."""
    s, m, topo = sim.settings, sim.metrics, sim.topology
    span = s.duration_s - s.warmup_s
    gpus = topo.num_gpus
    nic_bytes = sim.network.nic_bytes
    nic_peak = max(nic_bytes.values(), default=0.0)
    out: dict[str, Any] = {
        "pool": s.pool, "servers": topo.num_servers, "sessions": s.num_sessions, "duration_s": s.duration_s,
        "warmup_s": s.warmup_s, "think_scale": sim.think_scale, "affinity_max_queue": s.affinity_max_queue,
        "turns": m.turns_prefilled, "turns_done": m.turns_done,
        "throughput_per_gpu": (m.window_prompt_tokens + m.window_output_tokens) / span / gpus,
        "throughput_per_gpu_computed": (m.window_computed_tokens + m.window_output_tokens) / span / gpus,
        "turns_per_s": m.turns_done / span,
        **m.shares(),
        "placements": m.placements(),
        "trace_bound": sim.trace_bound(),
        "counted_turns": m.counted_turns, "counted_prompt_tokens": m.prompt_tokens,
        "chunk_prefix_bound": sim._bound_hits / (m.prompt_tokens or 1),
        "ttft_p50_s": percentile(m.ttft_s, 50), "ttft_p90_s": percentile(m.ttft_s, 90),
        "ttft_p99_s": percentile(m.ttft_s, 99),
        "queue_p50_s": percentile(m.queue_s, 50), "queue_p90_s": percentile(m.queue_s, 90),
        "restore_p50_ms": percentile(m.restore_s, 50) * 1e3,
        "restore_tokens_p50": percentile([float(n) for n in m.restore_tokens], 50) * sim.cost.model.chunk_tokens,
        "stage_spread_p50_s": percentile(m.spread_s, 50),
        "stage_spread_mean_s": sum(m.spread_s) / max(1, len(m.spread_s)),
        "lookup_wait_p50_ms": percentile(m.lookup_wait_s, 50) * 1e3,
        "lookup_wait_p99_ms": percentile(m.lookup_wait_s, 99) * 1e3,
        "prefill_busy": m.prefill_busy_s / span / len(sim.pipelines),
        "prefill_compute_share": m.compute_s / max(m.prefill_busy_s, 1e-9),
        "ttft_mean_s": sum(m.ttft_s) / max(1, len(m.ttft_s)),
        "decode_mean_s": sum(m.decode_s) / max(1, len(m.decode_s)),
        # TTFT's last part: the handoff's end to the first decoded token (decode's queue and its first step)
        "first_token_wait_mean_s": sum(m.first_token_wait_s) / max(1, len(m.first_token_wait_s)),
        "think_mean_s": sum(m.think_s) / max(1, len(m.think_s)),
        "decode_kv_use_p50": percentile(m.decode_use, 50),
        "decode_kv_reserved_p50": percentile(m.decode_reserved, 50),
        "decode_waiting_mean": sum(m.decode_waiting) / max(1, len(m.decode_waiting)),
        "prefill_queue_mean": sum(m.prefill_queue) / max(1, len(m.prefill_queue)),
        "pool_use_p50": percentile(m.pool_use, 50),
        "write_back_chunks": m.write_back_chunks,
        "trace_policy": dict(sim.trace_policy, context_tokens=topo.max_context),
        "masters": len(sim.indexes),
        "master_lookups_per_s": m.master_lookups / s.duration_s / len(sim.indexes),
        "master_puts_per_s": m.put_objects / s.duration_s / len(sim.indexes),
        "master_evictions_per_s": m.evicted_groups / s.duration_s / len(sim.indexes),
        "master_ops_per_s": max(q.num_ops for q in sim.masters) / s.duration_s,
        "master_utilization": max(q.busy_s for q in sim.masters) / s.duration_s,
        # what the busiest master could serve, at this run's mix of operations
        "master_capacity_ops_per_s": max(q.num_ops / q.busy_s if q.busy_s else 0.0 for q in sim.masters),
        # after warm-up: every master's service seconds and operations per turn prefilled (the steady mix)
        "master_s_per_turn": sum(q.counted_busy_s for q in sim.masters) / max(1, m.counted_turns),
        "master_ops_per_turn": sum(q.counted_ops for q in sim.masters) / max(1, m.counted_turns),
        "cross_server_bytes_per_s_per_nic": sum(nic_bytes.values()) / s.duration_s / topo.num_servers,
        "cross_server_bytes_per_s_peak_nic": nic_peak / s.duration_s,
        "dropped_objects": sim.dropped_objects,
        "wall_s": wall_s, "sim_speed": s.duration_s / max(wall_s, 1e-9), "events": sim.loop.num_events,
    }
    nic = topo.nic_gbps * 1e9
    out["nic_use"] = out["cross_server_bytes_per_s_per_nic"] / nic
    out["nic_use_peak"] = out["cross_server_bytes_per_s_peak_nic"] / nic
    out["windows"] = m.window_series()
    out["settling"] = settling(out["windows"], s.warmup_s, s.duration_s, s.window_s)
    out["steady"] = out["settling"]["steady"]
    out["sched"] = s.sched
    out["prompt_tok_s"] = m.window_prompt_tokens / span
    # restore time on the critical path, per turn prefilled (a turn that restores nothing adds 0)
    out["restore_critical_s_per_turn"] = sum(m.restore_s) / max(1, m.counted_turns)
    out["errors"] = sum(sim.trace_policy[k] for k in ("refused_device_cache", "refused_decode", "expired_in_queue"))
    out["ttft_breakdown"] = ttft_breakdown(m.ttft_parts)
    out["queue_overdue_pops"] = sum(p.queue.num_overdue_pops for p in sim.pipelines.values())
    out["queue_budget_pops"] = sum(p.queue.num_budget_pops for p in sim.pipelines.values())
    out["queue_backlog_pops"] = sum(p.queue.num_backlog_pops for p in sim.pipelines.values())
    if sim.sessions is not None:
        out.update(sim.sessions.figures())
    if s.keep_ttft_samples:
        out["ttft_samples"] = list(m.ttft_s)
    return out
