"""Which path a piece's hidden states take to the next stage (``kvpool.core.prefill.stage_forward.activation_path``):
the sender's declared host decides, as a pool segment's does."""

from __future__ import annotations

import dataclasses

from kvpool.core.pool.paths import BytePath, SharedMemoryRef
from kvpool.core.prefill.stage_forward import Activation, activation_path

SHARED = SharedMemoryRef("/run/kvpool/prefill-stage0.sock", "send-arena", "0123abcd")
BASE = 1 << 30


def activation(**change: object) -> Activation:
    a = Activation(num_tokens=256, hidden_size=64, endpoint="127.0.0.1:9", address=BASE + 8192, size=65536,
                   host="node-a", shared=SHARED, shared_base_address=BASE)
    return dataclasses.replace(a, **change)


def test_a_receiver_on_the_senders_declared_host_copies_from_its_shared_arena() -> None:
    assert activation_path(activation(), "node-a") is BytePath.MEMORY
    assert activation_path(activation(endpoint=""), "node-a") is BytePath.MEMORY  # a sender with no engine


def test_a_receiver_on_another_host_reads_by_engine_even_with_the_arena_offered() -> None:
    assert activation_path(activation(), "node-b") is BytePath.ENGINE


def test_no_shared_arena_or_no_declared_host_reads_by_engine() -> None:
    assert activation_path(activation(shared=None, shared_base_address=0), "node-a") is BytePath.ENGINE
    assert activation_path(activation(host=""), "") is BytePath.ENGINE  # an older sender: no host, no arena
    assert activation_path(activation(host="", shared=None, shared_base_address=0), "node-a") is BytePath.ENGINE
    assert activation_path(activation(), "") is BytePath.ENGINE  # a receiver that declares no host


def test_the_bytes_start_at_their_address_less_the_arenas_base() -> None:
    assert activation().shared_offset == 8192
