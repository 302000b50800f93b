"""Registered memory: a range left registered after its memory was freed is named, not a bare -7."""

from __future__ import annotations

import pytest

from kvpool.transfer import HostBuffer, TransferEngine, TransferError


def test_overlapping_registration_is_refused_by_name_and_unregister_frees_the_range() -> None:
    engine = TransferEngine()
    buf = HostBuffer(1 << 20)
    engine.register(buf.address, 4096)
    engine.register(buf.address, 4096)  # again: a no-op
    engine.register(buf.address, 1 << 20)  # the same start, longer: registered anew
    with pytest.raises(TransferError, match="overlaps .* never unregistered"):
        engine.register(buf.address + 8192, 4096)
    engine.unregister(buf.address)
    engine.register(buf.address + 8192, 4096)  # the range is free again
    engine.unregister(buf.address + 8192)
    buf.close()
