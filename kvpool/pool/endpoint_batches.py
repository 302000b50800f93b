"""One batch transfer per store segment, the segments in parallel: how the pool client moves bytes.

Bytes move only with the transfer engine, straight between the caller's
registered buffers and store DRAM (no copies in between): one batch transfer
per remote endpoint per call, the endpoints in parallel (or one after the
other in one thread when every move would spin a core), each object of a read
verified as it lands (``TransferEngine.move``).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any, overload

from kvpool.pool.objects import ReadStatus, checksum
from kvpool.transfer import Move, TransferEngine, spins


@overload
async def move_by_endpoint(engine: TransferEngine, moves: list[Move], write: bool) -> list[bool]: ...


@overload
async def move_by_endpoint(engine: TransferEngine, moves: list[Move], write: bool,
                           expected: list[int]) -> list[ReadStatus]: ...


async def move_by_endpoint(engine: TransferEngine, moves: list[Move], write: bool,
                           expected: list[int] | None = None) -> list[bool] | list[ReadStatus]:
    """One batch per remote endpoint, endpoints in parallel; per-move success.

    With ``expected`` checksums each object is verified in the worker
    thread as soon as it lands, while later objects are still in flight,
    and each move's answer is a ``ReadStatus``.
    """
    if not moves:
        return []
    by_endpoint: dict[str, list[int]] = defaultdict(list)
    for i, move in enumerate(moves):
        by_endpoint[move.endpoint].append(i)

    def one(indices: list[int]) -> list[Any]:
        batch = [moves[i] for i in indices]
        endpoint = batch[0].endpoint
        local = [m.local for m in batch]
        remote = [m.remote for m in batch]
        sizes = [m.size for m in batch]
        if expected is None:
            return engine.move(endpoint, local, remote, sizes, write)
        want = [expected[i] for i in indices]
        verified = [False] * len(batch)

        def verify(j: int) -> None:
            verified[j] = checksum(local[j], sizes[j]) == want[j]

        done = engine.move(endpoint, local, remote, sizes, write, landed=verify)
        return [ReadStatus.NOT_READ if not d else ReadStatus.VERIFIED if v else ReadStatus.CORRUPT
                for d, v in zip(done, verified)]

    if all(spins(sum(moves[i].size for i in idx)) for idx in by_endpoint.values()):
        # every endpoint's move spins a core: run them one after the other in
        # one thread, so the spinners do not fight over cores
        def all_in_turn() -> list[list[Any]]:
            return [one(idx) for idx in by_endpoint.values()]

        outcomes = await asyncio.to_thread(all_in_turn)
    else:
        outcomes = await asyncio.gather(*(asyncio.to_thread(one, idx) for idx in by_endpoint.values()))
    result: list[Any] = [False if expected is None else ReadStatus.NOT_READ] * len(moves)
    for indices, flags in zip(by_endpoint.values(), outcomes):
        for i, flag in zip(indices, flags):
            result[i] = flag
    return result
