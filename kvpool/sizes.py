"""Byte sizes as people write them on a command line or in a TOML file."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int, field_name: str = "size") -> int:
    """``"256MiB"`` → 268435456; ints pass through. Raises ValueError naming the field."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name}: expected a byte size, got {value!r}")
    if isinstance(value, int):
        number = value
    else:
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{field_name}: {value!r} is not a size like 4096, 512MiB or 2GiB")
        number = int(float(match.group(1)) * _UNITS[unit])
    if number <= 0:
        raise ValueError(f"{field_name}: must be positive, got {value!r}")
    return number


def format_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")
