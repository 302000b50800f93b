"""A simulated decode shard: the core's ``ShardRoom`` (pages reserved at the router's ticket, before prefill)
and ``DecodeScheduler`` (the batch), stepped in runs.

Every running sequence is in every step (continuous batching). Stepping one
token at a time would be per-token work (~400 steps per turn, tens of
millions per run), so the shard plans a run of k steps at once: up to the
first sequence to finish, at the batch and KV size of the run (the KV grows
by one token per sequence per step: the mean over the run is used). A
sequence submitted meanwhile cuts the run at the end of the step in progress,
so it joins at the next step boundary, as with real continuous batching.

A sequence's first decoded token is the end of the first step it is in
(``on_first_token``): the time to it counts the handoff, the wait for the
batch and that step. The core's per-token calls (``on_step``, ``on_token``) are not made: output
counts live here. The room (pages for a sequence's whole life, taken when the
router's ticket reaches the shard, given back at the end: ``RouterSim``), the
batch's FIFO admission and release are the core's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.core.decode.scheduler import DecodeScheduler
from kvpool.core.decode.shard_room import ShardRoom
from kvpool.tools.sim.cost_model import CostModel
from kvpool.tools.sim.events import EventLoop
from kvpool.tools.sim.job import Job


@dataclass(slots=True)
class ShardSim:
    """One decode shard on ``server``; ``on_done`` reports a sequence's last token (its room goes back there)."""

    name: str
    server: int
    loop: EventLoop
    cost: CostModel
    room: ShardRoom
    on_done: Callable[[Job], None]
    # a sequence's first decoded token (the end of its first step in the batch): TTFT ends there
    on_first_token: Callable[[Job], None] | None = None
    jobs: dict[str, Job] = field(default_factory=dict)
    remaining: dict[str, int] = field(default_factory=dict)
    kv_tokens: int = 0  # KV entries held by running sequences
    _epoch: int = 0
    _run_start: float = 0.0
    _step_s: float = 0.0
    _run_steps: int = 0
    _stepping: bool = False
    num_steps: int = 0

    @property
    def scheduler(self) -> DecodeScheduler:
        return self.room.scheduler

    @property
    def num_pages(self) -> int:
        return self.scheduler.pages.num_pages

    def free_pages(self) -> int:
        return self.scheduler.pages.num_free

    def filled_pages(self) -> int:
        """Pages holding KV now: each running sequence's prompt and the tokens it has decoded so far
        (pages reserved for tokens not yet decoded are not filled)."""
        page = self.scheduler.page_size
        into_run = 0
        if self._stepping and self._step_s > 0:
            into_run = min(self._run_steps, math.floor((self.loop.now - self._run_start) / self._step_s))
        filled = 0
        for seq_id, remaining in self.remaining.items():
            seq = self.scheduler.get(seq_id)
            if seq is None:
                continue
            decoded = seq.max_tokens - remaining + into_run
            filled += -(-(seq.num_prompt_tokens + decoded) // page)
        return filled

    def submit(self, job: Job) -> None:
        """Queue a sequence whose room the shard holds (its KV has landed) for the batch."""
        self.scheduler.submit(job.job_id, job.turn.input_tokens, max(1, job.turn.output_tokens))
        self.jobs[job.job_id] = job
        if self._stepping:
            self._cut()
        else:
            self._plan()

    def _cut(self) -> None:
        """End the current run at the end of the step in progress."""
        done = min(self._run_steps, math.floor((self.loop.now - self._run_start) / self._step_s) + 1)
        if done < self._run_steps:
            self._epoch += 1
            self._run_steps = done
            self.loop.at(self._run_start + done * self._step_s, self._end, self._epoch)

    def _plan(self) -> None:
        admitted = self.scheduler.admit()
        for seq in admitted:
            self.remaining[seq.seq_id] = seq.max_tokens
            self.kv_tokens += seq.num_prompt_tokens
        if not self.remaining:
            self._stepping = False
            return
        batch = len(self.remaining)
        steps = min(self.remaining.values())
        self._step_s = self.cost.decode_step_s(batch, self.kv_tokens + batch * (steps - 1) / 2)
        self._epoch += 1
        self._run_start = self.loop.now
        self._run_steps = steps
        self._stepping = True
        if self.on_first_token is not None:  # a run is never cut inside its first step: its end is the token
            for seq in admitted:
                self.loop.at(self.loop.now + self._step_s, self.on_first_token, self.jobs[seq.seq_id])
        self.loop.at(self.loop.now + steps * self._step_s, self._end, self._epoch)

    def _end(self, epoch: int) -> None:
        if epoch != self._epoch:
            return  # a cut replaced this run
        steps = self._run_steps
        self.num_steps += steps
        finished = []
        for seq_id in self.remaining:
            self.remaining[seq_id] -= steps
            if self.remaining[seq_id] <= 0:
                finished.append(seq_id)
        self.kv_tokens += steps * len(self.remaining)
        for seq_id in finished:
            seq = self.scheduler.get(seq_id)
            del self.remaining[seq_id]
            if seq is not None:
                self.kv_tokens -= seq.num_prompt_tokens + seq.max_tokens  # what admit and the steps added
            self.on_done(self.jobs.pop(seq_id))  # the router's end gives the room back
        self._plan()
