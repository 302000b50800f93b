"""The simulator's cost model: how long prefill, restore, decode and the handoff take.

Pure: read from a small TOML file (``cost_model.toml`` beside this module is
the default, with the source of every number in its comments), validated on
load; a bad value raises ``ValueError`` naming ``[table] field``.

Invariants: every time and rate is finite and non-negative, bandwidths and
sizes positive; the functions are pure in their arguments.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

DEFAULT_COST_MODEL = Path(__file__).with_name("cost_model.toml")
# the local cluster `kvpool simulate --validate` starts (tiny model, float32 KV, this host's CPUs)
CPU_COST_MODEL = Path(__file__).with_name("cost_model_cpu.toml")


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int = 61
    kv_entry_bytes: int = 576
    chunk_tokens: int = 256

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_entry_bytes


@dataclass(frozen=True, slots=True)
class PrefillCost:
    chunk_base_s: float = 0.00124
    chunk_per_context_token_s: float = 8.46e-8
    # 0: stages overlap on successive chunks of a request (one stage-time per chunk plus the fill);
    # 1: each stage computes the request's whole span before the next stage starts (num_stages
    # stage-times per chunk, no fill), as kvpool's stage processes do with one forward per request
    sequential_stages: int = 0
    # tokens a stage forwards at once and passes on (0: one chunk): the next stage starts a piece when the
    # previous stage has finished it, so a request shorter than a piece goes through the stages one after
    # another (``stage_times``)
    forward_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StageTimes:
    """One request's compute on one stage: ``span_s`` in all; its first and its last forwarded piece."""

    span_s: float
    first_piece_s: float
    last_piece_s: float


@dataclass(frozen=True, slots=True)
class RestoreCost:
    read_gbps_per_gpu: float = 6.5
    per_object_s: float = 5.0e-5


@dataclass(frozen=True, slots=True)
class DecodeCost:
    step_base_s: float = 0.040
    step_per_seq_s: float = 0.00019
    step_per_kv_token_s: float = 1.76e-9


@dataclass(frozen=True, slots=True)
class HandoffCost:
    gbps: float = 50.0
    per_transfer_s: float = 2.0e-5
    max_transfer_bytes: int = 8 << 20
    # a fixed time per request outside restore, compute and the bytes' transfer (router, gRPC hops,
    # decode's Reserve/Generate, HTTP), charged with the handoff: between prefill's end and the first token
    per_request_s: float = 0.0
    # and a time per prompt token on that path (the router's HTTP front takes the prompt's token ids as JSON)
    per_prompt_token_s: float = 0.0


@dataclass(frozen=True, slots=True)
class MasterCost:
    """One pool master's service time per operation (it serves one at a time: ``network.MasterQueue``)."""

    lookup_base_s: float = 0.0
    lookup_per_group_s: float = 0.0
    put_base_s: float = 0.0  # a save's put_start + put_end, each a call
    put_per_object_s: float = 0.0
    release_s: float = 0.0  # a lease's release
    cpu_scale: float = 1.0  # the master's host against the host the times were measured on (time x this)


@dataclass(frozen=True, slots=True)
class FitInputs:
    """The calibration's inputs (``kvpool simulate --calibrate`` fits them; everything else is fixed)."""

    device_kv_gib_per_gpu: float = 100.0  # effective KV per prefill GPU
    prefill_level: float = 1.0  # multiplies every [prefill] chunk time
    decode_level: float = 1.0  # multiplies every [decode] step time (not fitted)
    think_scale: float = 1.0  # multiplies each turn's recorded think time
    decode_kv_gib_per_gpu: float = 0.0  # effective KV per decode GPU; 0: as a prefill GPU's


# fields that must be > 0 (the rest must be >= 0)
_POSITIVE = {"num_layers", "kv_entry_bytes", "chunk_tokens", "read_gbps_per_gpu", "gbps", "max_transfer_bytes",
             "device_kv_gib_per_gpu", "prefill_level", "decode_level", "cpu_scale"}
_FLAGS = {"sequential_stages"}  # integers that must be 0 or 1
_TABLES = {"model": ModelShape, "prefill": PrefillCost, "restore": RestoreCost, "decode": DecodeCost,
           "handoff": HandoffCost, "master": MasterCost, "fit": FitInputs}


@dataclass(frozen=True, slots=True)
class CostModel:
    """Times in seconds for the simulated work (see ``cost_model.toml``)."""

    model: ModelShape = ModelShape()
    prefill: PrefillCost = PrefillCost()
    restore: RestoreCost = RestoreCost()
    decode: DecodeCost = DecodeCost()
    handoff: HandoffCost = HandoffCost()
    master: MasterCost = MasterCost()
    fit: FitInputs = FitInputs()

    def compute_s(self, first_token: int, num_tokens: int, num_stages: int) -> float:
        """Time through an idle pipeline to compute tokens ``[first_token, first_token + num_tokens)``.

        A stage forwards a request in pieces (``stage_times``); the next stage
        takes each piece when the previous one has finished it, so an idle
        pipeline takes one stage's span plus ``num_stages - 1`` piece times to
        fill (one chunk's by default; with ``prefill.sequential_stages`` the
        whole span: ``num_stages`` spans). A chunk's cost is linear in its
        context, so every sum is closed form (no per-chunk work: a turn
        computes up to ~450 chunks).
        """
        if num_tokens <= 0:
            return 0.0
        t = self.stage_times(first_token, num_tokens)
        return t.span_s + (num_stages - 1) * max(t.first_piece_s, t.last_piece_s)

    def _piece_s(self, first_token: float, num_tokens: float) -> float:
        """One stage's time for tokens ``[first_token, first_token + num_tokens)`` (chunks at their mean context)."""
        c = self.model.chunk_tokens
        p = self.prefill
        mean_context = first_token + (num_tokens - c) / 2 if num_tokens > c else first_token
        return self.fit.prefill_level * num_tokens / c * (p.chunk_base_s + p.chunk_per_context_token_s * mean_context)

    def stage_times(self, first_token: int, num_tokens: int) -> StageTimes:
        """One stage's span over the request, and its first and last piece of ``forward_tokens`` (one chunk
        when 0; the whole span with ``sequential_stages``): what the flow of stages needs
        (``prefill_sim.stage_schedule``)."""
        if num_tokens <= 0:
            return StageTimes(0.0, 0.0, 0.0)
        span = self._piece_s(first_token, num_tokens)
        if self.prefill.sequential_stages:
            return StageTimes(span, span, span)
        piece = min(self.prefill.forward_tokens or self.model.chunk_tokens, num_tokens)
        return StageTimes(span, self._piece_s(first_token, piece),
                          self._piece_s(first_token + num_tokens - piece, piece))

    def restore_s(self, num_chunks: int, stage_bytes_per_token: float) -> float:
        """One GPU reads its stage's objects of ``num_chunks`` chunks (the stages read at once)."""
        if num_chunks <= 0:
            return 0.0
        nbytes = num_chunks * self.model.chunk_tokens * stage_bytes_per_token
        return nbytes / (self.restore.read_gbps_per_gpu * 1e9) + num_chunks * self.restore.per_object_s

    def decode_step_s(self, batch_size: int, kv_tokens: float) -> float:
        d = self.decode
        return self.fit.decode_level * (d.step_base_s + d.step_per_seq_s * batch_size + d.step_per_kv_token_s * kv_tokens)

    def lookup_s(self, num_groups: int) -> float:
        m = self.master
        return m.cpu_scale * (m.lookup_base_s + m.lookup_per_group_s * num_groups)

    def put_s(self, num_objects: int) -> float:
        m = self.master
        return m.cpu_scale * (m.put_base_s + m.put_per_object_s * num_objects)

    def release_s(self) -> float:
        return self.master.cpu_scale * self.master.release_s

    def handoff_s(self, nbytes: int, num_stages: int) -> float:
        """Every stage writes its slab in <= ``max_transfer_bytes`` writes; the stages write at once;
        plus the request's fixed ``per_request_s`` and ``per_prompt_token_s`` for each of its
        ``nbytes / kv_bytes_per_token`` tokens."""
        h = self.handoff
        stage_bytes = nbytes / num_stages
        num_transfers = math.ceil(stage_bytes / h.max_transfer_bytes)
        front = h.per_request_s + nbytes / self.model.kv_bytes_per_token * h.per_prompt_token_s
        return stage_bytes / (h.gbps * 1e9) * num_stages + num_transfers * h.per_transfer_s + front


def parse_cost_model(document: dict[str, object], where: str = "cost model") -> CostModel:
    """A ``CostModel`` from a decoded TOML document; unknown or bad fields raise ``ValueError`` naming them."""
    unknown = sorted(set(document) - set(_TABLES))
    if unknown:
        raise ValueError(f"{where}: [{unknown[0]}]: unknown table (expected one of {sorted(_TABLES)})")
    parts = {}
    for table, cls in _TABLES.items():
        values = document.get(table, {})
        if not isinstance(values, dict):
            raise ValueError(f"{where}: [{table}]: expected a table")
        known = {f.name: f for f in fields(cls)}
        for name in values:
            if name not in known:
                raise ValueError(f"{where}: [{table}] {name}: unknown field")
        kwargs = {}
        for name, f in known.items():
            if name not in values:
                continue
            value = values[name]
            want_int = isinstance(f.default, int)
            if isinstance(value, bool) or not isinstance(value, int | float) or (want_int and not isinstance(value, int)):
                kind = "an integer" if want_int else "a number"
                raise ValueError(f"{where}: [{table}] {name}: expected {kind}, got {value!r}")
            if not math.isfinite(value) or value < 0 or (name in _POSITIVE and value == 0):
                bound = "> 0" if name in _POSITIVE else ">= 0"
                raise ValueError(f"{where}: [{table}] {name}: must be finite and {bound}, got {value!r}")
            if name in _FLAGS and value not in (0, 1):
                raise ValueError(f"{where}: [{table}] {name}: must be 0 or 1, got {value!r}")
            kwargs[name] = value if want_int else float(value)
        parts[table] = cls(**kwargs)
    return CostModel(**parts)


def load_cost_model(path: Path | str = DEFAULT_COST_MODEL) -> CostModel:
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    return parse_cost_model(document, str(path))


def cost_model_path(args: object) -> str:
    """``--cost-model``, else the seed's model for the matrix and the local CPU cluster's for ``--validate``."""
    given = getattr(args, "cost_model", None)
    if given:
        return str(given)
    return str(CPU_COST_MODEL if getattr(args, "validate", False) else DEFAULT_COST_MODEL)
