"""The simulator's cost model: how long prefill, restore, decode and the handoff take.

Pure: read from a small TOML file (``cost_model.toml`` beside this module is
the default), validated on load; a bad value raises ``ValueError`` naming
``[table] field``. Provenance: the file's ``[sources]`` table names where each
constant came from (``provenance``: a dated bench record under docs/results,
the seed's text and hardware, or "fitted" for the ``[fit]`` inputs the
calibration sets); ``[master] record`` names the ``kvpool bench master``
record the master's service times are read from (``master_cost_from_bench``),
so repointing the price at a newer run is changing that one name.

Invariants: every time and rate is finite and non-negative, bandwidths and
sizes positive; the functions are pure in their arguments.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

DEFAULT_COST_MODEL = Path(__file__).with_name("cost_model.toml")
# dated records of the benches (``kvpool bench ... --json``), where ``[master] record`` and bench sources point
RESULTS_DIR = Path(__file__).resolve().parents[3] / "docs" / "results"
# the seed's text (the comparison this project reproduces); a source "seed: ..." points here
SEED_TEXT = "../shared/seed/000_7671f4ecc24755b8.txt"
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
    # a stage forwards a request in pieces that end at multiples of this many tokens (0: of one chunk), as the
    # services' stages do (``--forward-piece-tokens``: every request runs the same pieces), and passes each on
    # when it ends: the next stage starts a piece when the previous stage has finished it, so a request inside
    # one piece goes through the stages one after another (``stage_times``)
    forward_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StageTimes:
    """One request's compute on one stage: ``span_s`` in all, and its longest forwarded piece (every stage
    computes the same pieces in the same time: what an exact flow of the stages needs, ``stages.StageFlow``)."""

    span_s: float
    max_piece_s: float


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
    """One pool master's service time per operation (it serves one at a time: ``network.MasterQueue``).

    With ``[master] record`` the times are read from that ``kvpool bench master`` record
    (``master_cost_from_bench``); a time given beside it is refused (one source for the price).
    """

    lookup_base_s: float = 0.0
    lookup_per_group_s: float = 0.0
    put_base_s: float = 0.0  # a save's put_start + put_end, each a call
    put_per_object_s: float = 0.0
    release_s: float = 0.0  # a lease's release
    cpu_scale: float = 1.0  # the master's host against the host the times were measured on (time x this)
    record: str = ""  # a kvpool bench master record under docs/results the times come from ("": given here)


def master_cost_from_bench(output: dict[str, object], cpu_scale: float = 1.0, record: str = "") -> MasterCost:
    """The master's service times from a ``kvpool bench master --json`` output: its largest scale's CPU per call.

    The bench measures, on a master holding its most objects, the CPU of one lookup of a ``history_chunks``
    history that hits, with its release (``lookup_cpu_ms``), of one save of ``save_chunks`` chunks x ``stages``
    objects (``save_cpu_ms``: one put_start and one put_end), and of the cheapest session message
    (``session_floor_cpu_ms``: what a call costs whatever it does). A release and each call's base are that
    floor; the rest of a lookup is spread over its groups, the rest of a save over its objects.
    ``turn_cpu_ms`` (a typical turn's calls) is not used here: ``bench_turn_check`` compares it.
    """
    try:
        scales = output["scales"]
        assert isinstance(scales, list) and scales
        top = max(scales, key=lambda s: s["objects"])
        floor = float(top["session_floor_cpu_ms"]) / 1e3
        lookup = float(top["lookup_cpu_ms"]) / 1e3
        save = float(top["save_cpu_ms"]) / 1e3
        groups = int(output["history_chunks"])  # type: ignore[call-overload]
        objects = int(output["save_chunks"]) * int(output["stages"])  # type: ignore[call-overload]
    except (KeyError, TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"[master] record {record or '(given)'}: not a kvpool bench master output ({exc!r})") from None
    if not 0 < 2 * floor < min(lookup, save):
        raise ValueError(f"[master] record {record}: a call's floor {floor * 1e3} ms does not fit its lookup and save")
    return MasterCost(lookup_base_s=floor, lookup_per_group_s=(lookup - 2 * floor) / groups, put_base_s=2 * floor,
                      put_per_object_s=(save - 2 * floor) / objects, release_s=floor, cpu_scale=cpu_scale,
                      record=record)


def bench_turn_check(master: MasterCost, output: dict[str, object]) -> dict[str, float]:
    """The bench's typical turn (a lookup of its history, the release, a save of its new chunks) priced by
    ``master`` against the bench's own ``turn_cpu_ms``: a figure the price was not read from."""
    top = max(output["scales"], key=lambda s: s["objects"])  # type: ignore[arg-type, index]
    turn = output["turn"]
    objects = int(turn["new_chunks"]) * int(output["stages"])  # type: ignore[index, call-overload]
    priced = (master.lookup_base_s + master.lookup_per_group_s * int(turn["history_chunks"])  # type: ignore[index]
              + master.release_s + master.put_base_s + master.put_per_object_s * objects) / master.cpu_scale
    return {"priced_ms": priced * 1e3, "measured_ms": float(top["turn_cpu_ms"]),
            "priced_over_measured": priced * 1e3 / float(top["turn_cpu_ms"])}


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
_STRINGS = {"record"}
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
    # "table.field" -> where the constant came from (the file's [sources]); empty for a model built in code
    sources: tuple[tuple[str, str], ...] = ()

    def compute_s(self, first_token: int, num_tokens: int, num_stages: int) -> float:
        """Time through an idle pipeline to compute tokens ``[first_token, first_token + num_tokens)``.

        A stage forwards a request in pieces (``stage_times``); the next stage
        takes each piece when the previous one has finished it. Every stage
        computes a piece in the same time, so an idle pipeline takes one
        stage's span plus ``num_stages - 1`` times its longest piece (a flow
        shop of equal stages). A chunk's cost is linear in its context, so
        every sum is closed form (no per-chunk work: a turn computes up to
        ~450 chunks).
        """
        if num_tokens <= 0:
            return 0.0
        t = self.stage_times(first_token, num_tokens)
        return t.span_s + (num_stages - 1) * t.max_piece_s

    def _piece_s(self, first_token: float, num_tokens: float) -> float:
        """One stage's time for tokens ``[first_token, first_token + num_tokens)`` (chunks at their mean context)."""
        c = self.model.chunk_tokens
        p = self.prefill
        mean_context = first_token + (num_tokens - c) / 2 if num_tokens > c else first_token
        return self.fit.prefill_level * num_tokens / c * (p.chunk_base_s + p.chunk_per_context_token_s * mean_context)

    def stage_times(self, first_token: int, num_tokens: int) -> StageTimes:
        """One stage's span over the request and its longest piece. Pieces end at multiples of
        ``forward_tokens`` (one chunk when 0), as the services' ``StageRunner.forward`` cuts them, so a request
        that crosses a multiple forwards two pieces or more however short; with ``sequential_stages`` the span
        is one piece. A piece's time grows with its context: the longest is the first, the last, or the last
        whole one before it."""
        if num_tokens <= 0:
            return StageTimes(0.0, 0.0)
        span = self._piece_s(first_token, num_tokens)
        if self.prefill.sequential_stages:
            return StageTimes(span, span)
        size, end = self.prefill.forward_tokens or self.model.chunk_tokens, first_token + num_tokens
        first_end = min(end, (first_token // size + 1) * size)
        last_start = max(first_token, (end - 1) // size * size)
        longest = max(self._piece_s(first_token, first_end - first_token), self._piece_s(last_start, end - last_start))
        if last_start - size >= first_end:  # a whole piece between them
            longest = max(longest, self._piece_s(last_start - size, size))
        return StageTimes(span, longest)

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
    unknown = sorted(set(document) - set(_TABLES) - {"sources"})
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
            if name in _STRINGS:
                if not isinstance(value, str):
                    raise ValueError(f"{where}: [{table}] {name}: expected a string, got {value!r}")
                kwargs[name] = value
                continue
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
    return CostModel(**parts, sources=_sources(document.get("sources", {}), where))


def _sources(values: object, where: str) -> tuple[tuple[str, str], ...]:
    """``[sources]``: ``"table.field" = "where it came from"``, each naming a field of the model."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: [sources]: expected a table")
    out = []
    for key, text in values.items():
        table, _, name = key.partition(".")
        if table not in _TABLES or name not in {f.name for f in fields(_TABLES[table])}:
            raise ValueError(f"{where}: [sources] {key}: names no field of the cost model")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: [sources] {key}: expected a non-empty string")
        out.append((key, text))
    return tuple(sorted(out))


def _with_master_record(cost: CostModel, where: str, results_dir: Path) -> CostModel:
    """``[master] record``: the master's times read from that bench record (none given beside it)."""
    master = cost.master
    if not master.record:
        return cost
    given = [f.name for f in fields(MasterCost)
             if f.name not in ("record", "cpu_scale") and getattr(master, f.name) != getattr(MasterCost(), f.name)]
    if given:
        raise ValueError(f"{where}: [master] {given[0]}: given beside record {master.record!r} (one source)")
    path = results_dir / master.record
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: [master] record: cannot read {path} ({exc})") from None
    output = document.get("output", document)
    return replace(cost, master=master_cost_from_bench(output, master.cpu_scale, master.record))


def provenance(cost: CostModel) -> dict[str, dict[str, object]]:
    """Every constant of the model with its value and source: ``[fit]`` inputs are ``fitted`` (the
    calibration sets them), ``[master]``'s times are the bench record's, the rest the file's ``[sources]``
    (a constant without one says so: ``"source": None``)."""
    named = dict(cost.sources)
    out: dict[str, dict[str, object]] = {}
    for table in _TABLES:
        part = getattr(cost, table)
        for f in fields(part):
            key = f"{table}.{f.name}"
            source = named.get(key)
            if table == "master" and cost.master.record and f.name not in ("cpu_scale", "record"):
                source = f"bench: {cost.master.record} (master_cost_from_bench)"
            out[key] = {"value": getattr(part, f.name), "source": source}
    return out


def load_cost_model(path: Path | str = DEFAULT_COST_MODEL, results_dir: Path = RESULTS_DIR) -> CostModel:
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    return _with_master_record(parse_cost_model(document, str(path)), str(path), results_dir)


def cost_model_path(args: object) -> str:
    """``--cost-model``, else the seed's model for the matrix and the local CPU cluster's for ``--validate``."""
    given = getattr(args, "cost_model", None)
    if given:
        return str(given)
    return str(CPU_COST_MODEL if getattr(args, "validate", False) else DEFAULT_COST_MODEL)
