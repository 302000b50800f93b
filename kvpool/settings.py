"""Service settings: defaults, overridden by a TOML file, overridden by flags.

Each service declares a dataclass of settings. ``kvpool <role> --config
cluster.toml`` reads the ``[<role>]`` table of the file; flags given on the
command line win over the file.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def load_settings(cls: type[T], section: str, config_path: str | None, flags: dict[str, Any]) -> T:
    """Build ``cls`` from defaults, then ``[section]`` of the TOML file, then flags.

    Flags whose value is None were not given. Unknown keys in the file are an
    error naming the key, so a typo never silently keeps a default.
    """
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    if config_path:
        path = Path(config_path)
        if not path.is_file():
            raise ValueError(f"--config: {path} is not a file")
        with path.open("rb") as fh:
            try:
                document = tomllib.load(fh)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"--config: {path}: {exc}") from exc
        table = document.get(section, {})
        if not isinstance(table, dict):
            raise ValueError(f"--config: [{section}] in {path} must be a table")
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ValueError(f"--config: unknown setting {section}.{key} in {path}")
            values[name] = value
    for name, value in flags.items():
        if value is not None and name in known:
            values[name] = value
    return cls(**values)
