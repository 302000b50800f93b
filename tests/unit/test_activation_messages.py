"""A piece's activation through its message and back (``kvpool.services.prefill.stage_client``): every field
survives, an older sender's message means the engine path, and a bad shared arena is refused naming its field."""

from __future__ import annotations

import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.core.pool.paths import SharedMemoryRef
from kvpool.core.prefill.stage_forward import Activation
from kvpool.rpc import prefill_pb2
from kvpool.services.prefill.stage_client import activation_message, piece_from_message

SHARED = SharedMemoryRef("/run/kvpool/prefill-stage0.sock", "send-arena", "0123abcd")


def through_message(activation: Activation) -> Activation:
    message = prefill_pb2.ForwardRequest(request_id="r", num_tokens=300, compute_start=0, piece_start=0,
                                         piece_end=256, activation=activation_message(activation))
    return piece_from_message(prefill_pb2.ForwardRequest.FromString(message.SerializeToString())).activation


def test_every_field_survives_the_message() -> None:
    sent = Activation(num_tokens=256, hidden_size=64, endpoint="127.0.0.1:9", address=(1 << 40) + 4096, size=65536,
                      host="node-a", shared=SHARED, shared_base_address=1 << 40)
    assert through_message(sent) == sent
    no_engine = Activation(num_tokens=256, hidden_size=64, address=4096, size=65536, host="node-a", shared=SHARED,
                           shared_base_address=4096)
    assert through_message(no_engine) == no_engine


def test_an_older_senders_activation_has_no_host_and_no_shared_arena() -> None:
    older = prefill_pb2.Activation(num_tokens=256, hidden_size=64, endpoint="127.0.0.1:9", address=4096, size=65536)
    message = prefill_pb2.ForwardRequest(request_id="r", num_tokens=256, activation=older)
    activation = piece_from_message(message).activation
    assert (activation.host, activation.shared, activation.shared_base_address) == ("", None, 0)


@pytest.mark.parametrize("shared, field", [
    (SharedMemoryRef("relative.sock", "send-arena", "ab"), "activation.shared_memory.socket_path"),
    (SharedMemoryRef("/s.sock", "", "ab"), "activation.shared_memory.name"),
    (SharedMemoryRef("/s.sock", "send-arena", "a b"), "activation.shared_memory.token"),
])
def test_a_bad_shared_arena_is_refused_naming_its_field(shared: SharedMemoryRef, field: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^{field}: "):
        through_message(Activation(num_tokens=256, hidden_size=64, address=4096, size=65536, host="node-a",
                                   shared=shared, shared_base_address=4096))
