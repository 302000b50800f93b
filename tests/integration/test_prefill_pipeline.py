"""The prefill pipeline on real processes: a master, two stores, four stage workers.

Restored KV must give the same answer as computing from scratch; a session's
turns take exactly the expected tokens from device and pool; incomplete groups
are never restored; bad input is rejected by field.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from kvpool import service
from kvpool.request_record import read_records, recording_children
from kvpool.tools.cluster import LocalPipeline, LocalPool
from kvpool.model import InProcessPipeline as ReferenceModel
from kvpool.model import get_config
from kvpool.model.sampling import greedy_token
from kvpool.rpc import pool_pb2, pool_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.integration.conftest import eventually, metric

pytestmark = pytest.mark.cluster

CHUNK = 256
# four 256-token blocks: one ~1000-token prompt fills the device cache, so the
# next prompt evicts it and its history must come back from the pool
DEVICE_TOKENS = 4 * CHUNK
CONFIG = get_config("tiny")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


def reference_logits(token_ids: list[int]) -> torch.Tensor:
    """Final-position logits computed from scratch, in this process."""
    blocks = -(-len(token_ids) // CHUNK)
    model = ReferenceModel(CONFIG, num_blocks=blocks, block_size=CHUNK)
    return model.forward(torch.tensor(token_ids), list(range(blocks)), 0)[-1]


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("records") / "requests.jsonl"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, records: Path) -> Iterator[tuple[LocalPool, LocalPipeline]]:
    workdir = tmp_path_factory.mktemp("prefill")
    # what each request saw, written by stage 0 and the master (kvpool simulate --validate reads these)
    with recording_children(records), \
            LocalPool(num_stores=2, segment_size="32MiB", workdir=workdir / "pool") as pool, \
            LocalPipeline(num_stages=4, master=pool.master_address, workdir=workdir / "stages",
                          stage_args=["--device-cache-tokens", str(DEVICE_TOKENS)]) as pipeline:
        yield pool, pipeline


@pytest.fixture
async def stubs(cluster) -> AsyncIterator[tuple[prefill_pb2_grpc.PrefillStub, pool_pb2_grpc.PoolMasterStub]]:  # type: ignore[no-untyped-def]
    pool, pipeline = cluster
    async with grpc.aio.insecure_channel(pipeline.address, options=service.GRPC_OPTIONS) as front, \
            grpc.aio.insecure_channel(pool.master_address) as master:
        yield prefill_pb2_grpc.PrefillStub(front), pool_pb2_grpc.PoolMasterStub(master)


async def run(stub: prefill_pb2_grpc.PrefillStub, token_ids: list[int], session: str = "s") -> prefill_pb2.PrefillResponse:
    response = await stub.Prefill(
        prefill_pb2.PrefillRequest(token_ids=token_ids, session_key=session, return_logits=True), timeout=120
    )
    return response  # nothing is held once it returned


def logits_of(response: prefill_pb2.PrefillResponse) -> torch.Tensor:
    return torch.frombuffer(bytearray(response.logits), dtype=torch.float32)


async def saved(master: pool_pb2_grpc.PoolMasterStub, num_groups: int) -> None:
    """Saves are off the critical path: wait until the pool holds the groups."""
    async def check() -> bool:
        return (await master.Stats(pool_pb2.StatsRequest())).num_complete_groups >= num_groups
    await eventually(check, what=f"{num_groups} complete groups in the pool")


def split(response: prefill_pb2.PrefillResponse) -> tuple[int, int, int]:
    f = response.figures
    return f.num_device_tokens, f.num_pool_tokens, f.num_computed_tokens


async def evict_device(stub: prefill_pb2_grpc.PrefillStub, seed: int) -> None:
    """A different prompt that needs every device block pushes the last one out."""
    await run(stub, prompt(seed, DEVICE_TOKENS - 10), session="other")


async def test_restored_kv_gives_the_same_answer_as_computing(stubs) -> None:  # type: ignore[no-untyped-def]
    front, master = stubs
    tokens = prompt(1, 900)  # 3 full chunks + 132 tokens
    first = await run(front, tokens)
    assert split(first) == (0, 0, 900)
    before = (await master.Stats(pool_pb2.StatsRequest())).num_complete_groups
    await saved(master, before)
    await evict_device(front, seed=2)
    again = await run(front, tokens)
    assert split(again) == (0, 768, 132)
    assert [f.num_chunks_restored for f in again.figures.restore] == [3, 3, 3, 3]
    assert all(f.bytes == 3 * CHUNK * 2 * CONFIG.kv_entry_dim * 4 for f in again.figures.restore)
    reference = reference_logits(tokens)
    for response in (first, again):
        assert response.first_token == greedy_token(reference, CONFIG)
        # bitwise: four stages in four processes, from scratch or after a restore, compute what one call here does
        assert torch.equal(logits_of(response), reference)


async def test_stage_0_and_the_master_record_what_each_request_saw(stubs, records) -> None:  # type: ignore[no-untyped-def]
    front, master = stubs
    tokens = prompt(41, 700)  # 2 full chunks + 188 tokens
    first = await run(front, tokens, session="recorded")
    before = (await master.Stats(pool_pb2.StatsRequest())).num_complete_groups
    await saved(master, before)
    await evict_device(front, seed=42)
    again = await run(front, tokens, session="recorded")
    assert split(again) == (0, 512, 188)

    def effects(request_id: str) -> list[str]:  # (a wait for blocks others' saves still hold left out)
        return [str(r["effect"]) for r in read_records(records) if r["source"] == "stage0"
                and r["kind"] == "effect" and r["request_id"] == request_id and r["effect"] != "WaitForBlocks"]

    def settled() -> bool:  # the save's free comes once every stage's save ended
        return effects(first.request_id).count("Freed") == 2
    await eventually(settled, what="the save's free recorded")
    assert effects(first.request_id) == ["Admitted", "Lookup", "Forward", "SavesThenFree", "Prefilled", "Freed",
                                         "Freed"]
    # the pool hit: its lease ends once the forward (and every stage's restore on its chain) ended; it
    # computed no full chunk, so it saves nothing
    assert effects(again.request_id) == ["Admitted", "Lookup", "Forward", "ReleaseLease", "Prefilled", "Freed"]
    touches = [r for r in read_records(records) if r["kind"] == "touch" and r["request_id"] == again.request_id]
    assert [t["session_key"] for t in touches] == ["recorded"]
    # after each admission, the device cache's evictions so far: evict_device's requests took the first's blocks
    evicted = {r["request_id"]: r["evicted"] for r in read_records(records) if r["kind"] == "blocks"}
    assert evicted[first.request_id] < evicted[again.request_id]
    def ops(request_id: str) -> list[tuple[str, object]]:
        return [(r["op"], r.get("complete", r.get("items"))) for r in read_records(records)
                if r["source"] == "master" and r["request_id"] == request_id]

    # the save: stage 0 reserves every stage's object of the 2 chunks in one put, and commits them in one
    assert ops(first.request_id) == [("lookup", 0), ("put_start", 8), ("put_end", 8)]
    # the lease's release is made beside the request (nobody waits for it): it reaches the master after
    await eventually(lambda: ("release", None) in ops(again.request_id), what="the lease's release recorded")
    assert ops(again.request_id)[0] == ("lookup", 2)
    # a pool hit that also saves a chunk: its save's first call ends the lease, after its put
    await evict_device(front, seed=43)
    longer = await run(front, tokens + prompt(44, 300), session="recorded")
    assert split(longer) == (0, 512, 488)
    await eventually(lambda: len(ops(longer.request_id)) == 4, what="the longer request's pool operations")
    assert ops(longer.request_id) == [("lookup", 2), ("put_start", 4), ("release", None), ("put_end", 4)]
    release = [r for r in read_records(records) if r["source"] == "master"
               and r["request_id"] == longer.request_id and r["op"] == "release"]
    assert [r.get("via") for r in release] == ["put_start"]


def pool_bytes(pipeline: LocalPipeline, path: str, direction: str) -> list[float]:
    sample = f'kvpool_prefill_pool_bytes_total{{direction="{direction}",path="{path}"}}'
    return [metric(stage, sample) for stage in pipeline.stages]


async def test_every_stage_restores_and_saves_by_memory_on_the_stores_host(stubs, cluster) -> None:  # type: ignore[no-untyped-def]
    # stores and stages share this host: every stage's pool bytes are copies, none go by the engine (issue 36)
    front, master = stubs
    _, pipeline = cluster
    tokens = prompt(31, 600)  # 2 full chunks + 88 tokens
    engine_before = pool_bytes(pipeline, "engine", "read"), pool_bytes(pipeline, "engine", "write")
    memory_before = pool_bytes(pipeline, "memory", "read")
    written_before = pool_bytes(pipeline, "memory", "write")
    before = (await master.Stats(pool_pb2.StatsRequest())).num_complete_groups
    await run(front, tokens, session="paths")
    await saved(master, before + 2)
    chunk_bytes = CHUNK * 2 * CONFIG.kv_entry_dim * 4  # one stage's layers of a chunk
    # stage 0 reserved every stage's objects; each stage wrote its own from its pages
    assert [a - b for a, b in zip(pool_bytes(pipeline, "memory", "write"), written_before)] == [2 * chunk_bytes] * 4
    await evict_device(front, seed=32)
    again = await run(front, tokens, session="paths")
    assert split(again) == (0, 512, 88)
    read = [a - b for a, b in zip(pool_bytes(pipeline, "memory", "read"), memory_before)]
    assert read == [2 * chunk_bytes] * 4
    assert (pool_bytes(pipeline, "engine", "read"), pool_bytes(pipeline, "engine", "write")) == engine_before


async def test_three_turn_session_takes_exact_tokens_from_device_and_pool(stubs) -> None:  # type: ignore[no-untyped-def]
    front, master = stubs
    turn1 = prompt(10, 600)  # chunks 0-1 full
    r1 = await run(front, turn1, session="three")
    assert split(r1) == (0, 0, 600)
    # turn 2 right after: history still on device
    turn2 = turn1 + [r1.first_token] + prompt(11, 200)  # 801 tokens: 3 full chunks
    r2 = await run(front, turn2, session="three")
    assert split(r2) == (512, 0, 289)
    groups = (await master.Stats(pool_pb2.StatsRequest())).num_complete_groups
    await saved(master, groups)
    # other work evicts the device copy; turn 3 restores from the pool
    await evict_device(front, seed=12)
    turn3 = turn2 + [r2.first_token] + prompt(13, 200)  # 1002 tokens: 3 full chunks, all in the pool
    r3 = await run(front, turn3, session="three")
    assert split(r3) == (0, 768, 234)
    reference = reference_logits(turn3)
    assert r3.first_token == greedy_token(reference, CONFIG)
    assert float((logits_of(r3) - reference).abs().max()) <= 1e-4


async def test_incomplete_group_is_never_restored(stubs, cluster) -> None:  # type: ignore[no-untyped-def]
    front, master = stubs
    pool, pipeline = cluster
    tokens = prompt(20, 800)
    await run(front, tokens)
    namespace = pipeline.stages[0].ready["namespace"]
    from kvpool.core.chunk_hash import chunk_hashes, group_id, object_key

    hashes = chunk_hashes(namespace, tokens, CHUNK)
    # this prompt's own groups, all written (earlier tests' groups count toward the pool's total)
    groups = [group_id(namespace, h) for h in hashes]

    async def all_saved() -> bool:
        return await pooled(master, groups) == len(groups)
    await eventually(all_saved, what="the prompt's 3 groups in the pool")
    # drop chunk 1's group and put back only three of its four members, with bytes
    # that would be wrong if anyone ever read them
    removed = await master.Remove(pool_pb2.RemoveRequest(group_ids=[group_id(namespace, hashes[1])]))
    assert removed.num_removed == 1
    size = CHUNK * 2 * CONFIG.kv_entry_dim * 4
    items = [pool_pb2.PutItem(key=object_key(namespace, hashes[1], s), group_id=group_id(namespace, hashes[1]),
                              group_size=4, size=size) for s in range(3)]
    started = await master.PutStart(pool_pb2.PutStartRequest(client_host="test", items=items))
    assert all(r.status == pool_pb2.PUT_STATUS_RESERVED for r in started.results)
    await master.PutEnd(pool_pb2.PutEndRequest(items=[pool_pb2.PutCommit(key=i.key, checksum=0) for i in items]))
    await evict_device(front, seed=21)
    again = await run(front, tokens)
    # chunk 0 comes from the pool; chunk 1's group is incomplete, so it and everything after are computed
    assert split(again) == (0, 256, 544)
    reference = reference_logits(tokens)
    assert float((logits_of(again) - reference).abs().max()) <= 1e-4


async def pooled(master: pool_pb2_grpc.PoolMasterStub, group_ids: list[str]) -> int:
    """Leading groups of ``group_ids`` complete in the pool (the lookup's lease released at once)."""
    found = await master.Lookup(pool_pb2.LookupRequest(group_ids=group_ids))
    await master.ReleaseLease(pool_pb2.ReleaseLeaseRequest(lease_id=found.lease_id))
    return len(found.groups)


async def test_a_staged_history_is_the_next_turns_device_hit(stubs, cluster) -> None:  # type: ignore[no-untyped-def]
    """Prefetch: a session's history, evicted from the device, is staged from the pool (every stage reads
    its objects, as a restore does) into the blocks of an idle session hinted back later; the session's
    next turn finds it on the device and restores nothing on its critical path."""
    from kvpool.core.chunk_hash import chunk_hashes, group_id

    front, master = stubs
    _, pipeline = cluster
    stage0 = pipeline.stages[0]
    namespace = stage0.ready["namespace"]
    tokens = prompt(85, 600)  # two full chunks
    groups = [group_id(namespace, h) for h in chunk_hashes(namespace, tokens, CHUNK)]
    first = await run(front, tokens, session="staged")
    assert split(first) == (0, 0, 600)

    async def both_pooled() -> bool:
        return await pooled(master, groups) == 2
    await eventually(both_pooled, what="the history's 2 groups in the pool")
    # an idle session, hinted back in a minute, takes every device block: its blocks are the room
    await run(front, prompt(86, DEVICE_TOKENS - 10), session="donor")
    # its save still reads its blocks a moment after Prefill returned, and a staging begun meanwhile may find
    # no block it can take (a loaded CI run timed out here once, the save ending 19 ms after the prefill): hint
    # once nothing holds a block
    await eventually(lambda: metric(stage0, "kvpool_prefill_device_cache_usage") == 0.0,
                     what="the donor's save done with its blocks")
    later = await front.Prefetch(prefill_pb2.PrefetchRequest(session_key="donor", expected_next_s=60))
    assert later.known and later.scheduled
    outcomes = ("staged", "on_device", "pressure", "pool_miss", "turn_came", "cancelled", "failed")

    def hints() -> dict[str, float]:
        return {o: metric(stage0, f'kvpool_prefetch_hints_total{{outcome="{o}"}}') for o in outcomes}

    used = 'kvpool_prefetch_bytes_total{kind="used"}'
    before = hints(), metric(stage0, used)
    now = await front.Prefetch(prefill_pb2.PrefetchRequest(session_key="staged", expected_next_s=0))
    assert now.known and now.scheduled
    # the staging ends with one outcome (a failed one says which, rather than timing out on "staged")
    await eventually(lambda: sum(hints().values()) > sum(before[0].values()), what="the staging's outcome")
    assert {o: n - before[0][o] for o, n in hints().items() if n != before[0][o]} == {"staged": 1}
    turn = tokens + [first.first_token] + prompt(87, 100)
    second = await run(front, turn, session="staged")
    assert split(second) == (512, 0, len(turn) - 512)  # the staged chunks are device hits
    assert not second.figures.restore  # nothing restored on the turn's path
    chunk_bytes = CHUNK * 2 * CONFIG.kv_entry_dim * 4
    assert metric(stage0, used) == before[1] + 2 * chunk_bytes * 4  # two chunks on every stage
    reference = reference_logits(turn)
    assert float((logits_of(second) - reference).abs().max()) <= 1e-4
    ended = await front.Prefetch(prefill_pb2.PrefetchRequest(session_key="donor", session_end=True))
    assert ended.known  # its staging, armed for a minute from now, is cancelled with it


async def test_device_hit_whose_pool_copy_is_gone_is_written_back(stubs, cluster) -> None:  # type: ignore[no-untyped-def]
    """The pool drops a prompt's groups while the device still holds them: the next turn's
    device hit saves them again from the pages, so they survive the device evicting them."""
    from kvpool.core.chunk_hash import chunk_hashes, group_id

    front, master = stubs
    pool, pipeline = cluster
    tokens = prompt(25, 900)
    namespace = pipeline.stages[0].ready["namespace"]
    groups = [group_id(namespace, h) for h in chunk_hashes(namespace, tokens, CHUNK)]
    assert split(await run(front, tokens)) == (0, 0, 900)

    async def all_pooled() -> bool:
        return await pooled(master, groups) == 3

    await eventually(all_pooled, what="the prompt's 3 groups in the pool")
    removed = await master.Remove(pool_pb2.RemoveRequest(group_ids=groups))
    assert removed.num_removed == 3 and await pooled(master, groups) == 0
    again = await run(front, tokens)
    assert split(again) == (768, 0, 132)  # device hit; the lookup found none of its groups
    await eventually(all_pooled, what="the 3 device-hit groups written back")
    await evict_device(front, seed=26)
    third = await run(front, tokens)
    assert split(third) == (0, 768, 132)
    reference = reference_logits(tokens)
    assert float((logits_of(third) - reference).abs().max()) <= 1e-4


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        ([], "token_ids: must not be empty"),
        ([1, 2, CONFIG.vocab_size], f"token_ids[2]: {CONFIG.vocab_size} is outside the vocabulary"),
        ([5, -1], "token_ids[1]: -1 is outside the vocabulary"),
        ([1] * (CONFIG.max_position_embeddings + 1), "exceed the model's context"),
        ([1] * (DEVICE_TOKENS + 1), "need 5 device blocks; the device cache holds 4"),
    ],
)
async def test_bad_prompts_are_rejected_by_field(stubs, token_ids: list[int], message: str) -> None:  # type: ignore[no-untyped-def]
    front, _ = stubs
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await front.Prefill(prefill_pb2.PrefillRequest(token_ids=token_ids, session_key="bad"), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")
    # still serving
    ok = await run(front, prompt(30, 50))
    assert split(ok)[2] == 50


async def test_the_callers_request_id_names_the_request(stubs) -> None:  # type: ignore[no-untyped-def]
    front, _ = stubs
    metadata = (("x-request-id", "cmpl-named-1"),)
    first = await front.Prefill(prefill_pb2.PrefillRequest(token_ids=prompt(70, 40)), metadata=metadata, timeout=120)
    assert first.request_id == "cmpl-named-1"
    # nothing is held once Prefill returned: the same id is free again at once
    again = await front.Prefill(prefill_pb2.PrefillRequest(token_ids=prompt(71, 40)), metadata=metadata, timeout=120)
    assert again.request_id == "cmpl-named-1"
    fresh = await run(front, prompt(72, 40))  # no id given: stage 0 makes one
    assert fresh.request_id.startswith("prefill-") and fresh.request_id != "cmpl-named-1"


async def test_concurrent_requests_all_complete(stubs) -> None:  # type: ignore[no-untyped-def]
    """Several requests in flight at once move through the stages together."""
    front, _ = stubs
    prompts = [prompt(40 + i, 200) for i in range(4)]
    responses = await asyncio.gather(*(run(front, p, session=f"c{i}") for i, p in enumerate(prompts)))
    for p, r in zip(prompts, responses):
        assert r.first_token == greedy_token(reference_logits(p), CONFIG)


async def test_cancelled_request_releases_its_blocks_and_others_stay_right(stubs, cluster) -> None:  # type: ignore[no-untyped-def]
    """A caller that goes away mid-prefill: the stages finish with its pages before they
    are reused; nothing leaks (the next request needs every block) and answers stay right."""
    front, _ = stubs
    _, pipeline = cluster
    stage0 = pipeline.stages[0]
    cancelled_running = 'kvpool_prefill_cancelled_total{phase="running"}'
    before = metric(stage0, cancelled_running)
    call = front.Prefill(prefill_pb2.PrefillRequest(token_ids=prompt(60, DEVICE_TOKENS - 10)),
                         metadata=(("x-request-id", "cancelled-mid-run"),), timeout=120)

    def admitted() -> bool:  # its blocks are taken and its stages run: the caller goes away now
        return any('"cancelled-mid-run"' in line and '"prefill_admitted"' in line
                   for line in stage0.log_file.read_text().splitlines())
    await eventually(admitted, what="the request admitted on stage 0")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    other = prompt(61, DEVICE_TOKENS - 10)
    response = await run(front, other)
    assert split(response) == (0, 0, len(other))
    reference = reference_logits(other)
    assert float((logits_of(response) - reference).abs().max()) <= 1e-4
    assert metric(stage0, cancelled_running) == before + 1
    assert any('"cancelled-mid-run"' in line and '"prefill_cancelled"' in line and '"running"' in line
               for line in stage0.log_file.read_text().splitlines())
