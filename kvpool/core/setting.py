"""One declaration per setting: default, help and choices on the dataclass field.

Pure: the service edge (``kvpool.settings``) derives the command-line flags
and reads the TOML table from these fields, so a setting's name, default and
meaning are written once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,  # noqa: A002 - argparse's word
    factory: Callable[[], Any] | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    default_text: str | None = None,
    flag: bool = True,
) -> Any:
    """A dataclass field that carries its flag's help.

    ``default_text`` replaces the shown default where the value is computed
    (e.g. "7700 + stage"); ``flag=False`` keeps a setting out of the command
    line (it can still be set in the TOML file).
    """
    metadata = {"help": help, "choices": choices, "metavar": metavar, "default_text": default_text, "flag": flag}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
