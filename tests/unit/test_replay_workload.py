"""The replay's inputs: the Mooncake JSONL reader, weka sessions at a scale, skipped turns, the device-cache check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.tools.replay.workload import DeviceCacheTooSmall, check_device_cache, load_workload, sent_block_bound
from kvpool.workload.mooncake import MooncakeRequest, load_mooncake, mooncake_block_bound

MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
VOCAB = 1024


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def line(ts: int, n: int, out: int, ids: list[int]) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}


def test_mooncake_lines_become_requests_in_seconds(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [line(0, 1000, 10, [0, 1]), "", line(1500, 1024, 3, [0, 2])])
    assert load_mooncake(path) == [
        MooncakeRequest(1, 0.0, 1000, 10, (0, 1)),  # ceil ids: the last block partial
        MooncakeRequest(3, 1.5, 1024, 3, (0, 2)),  # the blank line 2 is skipped
    ]
    assert load_mooncake(path, limit=1) == load_mooncake(path)[:1]
    # block 0 of the second request was seen: 512 of 2024 input tokens
    assert mooncake_block_bound(load_mooncake(path)) == 512 / 2024


@pytest.mark.parametrize(("bad", "message"), [
    ("{not json", "t.jsonl:2: not valid JSON"),
    (json.dumps(line(-1, 512, 1, [0])), "t.jsonl:2: timestamp"),
    (json.dumps(line(0, 512, 1, [0, 1, 2])), "t.jsonl:2: hash_ids: 3 ids for input_length=512"),
    (json.dumps({"timestamp": 0, "output_length": 1, "hash_ids": []}), "t.jsonl:2: input_length: missing"),
    (json.dumps(line(0, 512, 1, ["a"])), "t.jsonl:2: hash_ids: expected a list of integers"),
])
def test_mooncake_errors_name_the_line_and_field(tmp_path: Path, bad: str, message: str) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [line(0, 512, 1, [0]), bad])
    with pytest.raises(ValueError, match=message):
        load_mooncake(path)


@pytest.mark.skipif(not MOONCAKE.is_file(), reason="shared Mooncake traces not beside the checkout")
def test_the_real_conversation_trace_reads_whole() -> None:
    requests = load_mooncake(MOONCAKE)
    assert len(requests) == 12031
    assert all(len(r.hash_ids) == -(-r.input_tokens // 512) for r in requests)
    assert [r.t for r in requests] == sorted(r.t for r in requests)


def test_mooncake_replays_as_one_turn_arrivals_in_one_token_namespace(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [line(2000, 1024, 64, [5, 6]), line(3000, 1536, 16, [5, 6, 7])])
    workload = load_workload(path, scale=16, vocab_size=VOCAB, context=32768, max_tokens=8)
    assert workload.kind == "mooncake"
    assert [(s.id, s.arrival_s, len(s.turns)) for s in workload.sessions] == [("t-1", 0.0, 1), ("t-2", 1.0, 1)]
    first, second = (s.token_ids(s.turns[0], 16, VOCAB) for s in workload.sessions)
    assert (len(first), len(second)) == (64, 96)  # 512-token blocks become 32 tokens at scale 16
    assert second[:64] == first  # global ids: the shared blocks are the same tokens across requests
    assert [s.turns[0].max_tokens for s in workload.sessions] == [4, 1]  # output scaled, at least 1
    assert workload.trace_block_bound == 1024 / 2560


def weka_doc(requests: list[dict[str, Any]], system: int = 0, tool: int = 0) -> dict[str, Any]:
    return {"id": "w", "block_size": 64, "hash_id_scope": "local", "tool_tokens": tool, "system_tokens": system,
            "requests": requests}


def req(ids: list[int], out: int = 16) -> dict[str, Any]:
    return {"t": 0.0, "in": 64 * len(ids), "out": out, "hash_ids": ids, "think_time": 0.0}


def test_turns_beyond_the_context_are_skipped_counted_and_left_out_of_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_text(json.dumps(weka_doc([req([1]), req([1, 2, 3, 4]), req([1, 2])])))
    workload = load_workload(path, scale=1, vocab_size=VOCAB, context=200, max_tokens=8)
    # 256 + 8 > 200: the middle turn goes; the bound then counts block 1 of the last turn only
    assert workload.skipped_turns == 1
    assert [(t.index, t.prompt_tokens, t.max_tokens) for t in workload.sessions[0].turns] == [(0, 64, 8), (1, 128, 8)]
    assert workload.trace_block_bound == 64 / 192
    assert "w turn 1: 256 prompt + 8 output tokens > context 200" in workload.skipped_reasons[0]


def test_shared_prefix_leads_every_prompt_and_counts_in_its_length(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_text(json.dumps(weka_doc([req([1]), req([1, 2])], system=100, tool=60)))
    workload = load_workload(path, scale=16, vocab_size=VOCAB, context=32768, max_tokens=8, shared_prefix=True)
    session = workload.sessions[0]
    prompts = [session.token_ids(t, 16, VOCAB) for t in session.turns]
    assert [len(p) for p in prompts] == [t.prompt_tokens for t in session.turns] == [10 + 4, 10 + 8]
    assert prompts[0][:10] == prompts[1][:10]


def test_device_cache_check_names_scale_and_device_cache_tokens(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_text(json.dumps(weka_doc([req(list(range(1, 33)))])))  # 2048 tokens
    workload = load_workload(path, scale=4, vocab_size=VOCAB, context=32768, max_tokens=8)
    assert workload.longest_prompt == 512
    check_device_cache(workload, 512, 256)  # exactly two blocks: fits
    with pytest.raises(DeviceCacheTooSmall) as err:
        check_device_cache(workload, 511, 256)  # one whole block only
    assert str(err.value) == (
        "the longest turn is 512 tokens at --scale 4, more than the device cache of --device-cache-tokens 511 "
        "(256 tokens in whole 256-token blocks): raise --device-cache-tokens to at least 512 or raise --scale")


def test_block_bound_of_the_turns_sent_in_send_order(tmp_path: Path) -> None:
    for name in ("a", "b"):  # two sessions with the same local ids: no reuse across them
        doc = weka_doc([req([1]), req([1, 2]), req([1, 2, 3])])
        doc["id"] = name
        (tmp_path / f"trace_{name}.json").write_text(json.dumps(doc))
    workload = load_workload(tmp_path, scale=1, vocab_size=VOCAB, context=32768, max_tokens=8)
    assert workload.trace_block_bound == 2 * (64 + 128) / (2 * 384)
    # a run cut short: a's first two turns and b's first only
    assert sent_block_bound(workload, [("a", 0), ("b", 0), ("a", 1)]) == 64 / 256
    # sent out of time order, the later turn's blocks are what the earlier one reuses
    assert sent_block_bound(workload, [("a", 1), ("a", 0)]) == 64 / 192


def test_mooncake_block_bound_of_the_requests_sent_is_global(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [line(0, 1024, 1, [5, 6]), line(1, 1024, 1, [5, 9])])
    workload = load_workload(path, scale=16, vocab_size=VOCAB, context=32768, max_tokens=8)
    assert sent_block_bound(workload, [("t-1", 0), ("t-2", 0)]) == 512 / 2048
    assert sent_block_bound(workload, [("t-2", 0)]) == 0.0


def test_turns_keeps_the_first_turns_of_every_session_and_refuses_mooncake(tmp_path: Path) -> None:
    trace = tmp_path / "s.json"
    requests = [{"t": float(i), "in": 128 * (i + 1), "out": 8, "hash_ids": list(range(2 * (i + 1))),
                 "think_time": 0.0} for i in range(5)]
    trace.write_text(json.dumps({"id": "s", "block_size": 64, "hash_id_scope": "local", "tool_tokens": 0,
                                  "system_tokens": 0, "requests": requests}))
    whole = load_workload(trace, scale=1, vocab_size=1024, context=32768, max_tokens=8)
    cut = load_workload(trace, scale=1, vocab_size=1024, context=32768, max_tokens=8, turns=2)
    assert (whole.num_turns, cut.num_turns) == (5, 2)
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="^--turns: a Mooncake trace"):
        load_workload(mooncake, scale=1, vocab_size=1024, context=32768, max_tokens=8, turns=2)
    with pytest.raises(ValueError, match="^--turns: must be >= 1"):
        load_workload(trace, scale=1, vocab_size=1024, context=32768, max_tokens=8, turns=0)
