"""The forward chain's answer on the wire (``kvpool.services.prefill.stage_client``): every stage's handoff
figures ride back with it, and a later stage's handoff failure keeps naming the target."""

from __future__ import annotations

import grpc

from kvpool.core.errors import FailedPrecondition, Unavailable
from kvpool.core.handoff.target import StageHandoffFigures
from kvpool.core.prefill.stage_forward import StageForwardResult
from kvpool.services.prefill.stage_client import result_from_message, result_message, stage_error
from kvpool.status import FIELD_KEY


def test_the_answer_round_trips_with_every_stages_handoff_figures() -> None:
    result = StageForwardResult(first_token=7, logits=b"\x00\x01", stage_compute_ms=[1.5, 2.5],
                                handoff_stages=[StageHandoffFigures(stage=0, transfers=2, bytes=4096, ranges=1),
                                                StageHandoffFigures(stage=1, bytes=8192, gather_seconds=0.25,
                                                                    last_write_end_unix_ms=12.5)])
    assert result_from_message(result_message(result)) == result


class Failed(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str, field: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata((FIELD_KEY, field)), details)


def test_a_later_stages_handoff_failure_keeps_its_kind_and_the_target() -> None:
    expired = stage_error(Failed(grpc.StatusCode.FAILED_PRECONDITION, "the reservation expired",
                                 "target.deadline_unix_ms"), stage=2)
    assert isinstance(expired, FailedPrecondition) and expired.field == "target.deadline_unix_ms"
    unreachable = stage_error(Failed(grpc.StatusCode.UNAVAILABLE, "decode went away", "target"), stage=2)
    assert isinstance(unreachable, Unavailable) and unreachable.field == "target"
    # any other failure of a later stage is that stage unavailable, whatever its code said
    other = stage_error(Failed(grpc.StatusCode.INVALID_ARGUMENT, "piece_start: 3", "piece_start"), stage=2)
    assert isinstance(other, Unavailable) and not other.field and str(other).startswith("stage 2: ")
