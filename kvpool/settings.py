"""Service settings: defaults, overridden by a TOML file, overridden by flags.

Each service declares a dataclass of settings, every field once with its
default and help (``kvpool.core.setting.setting``); the flags are derived from
it. ``kvpool <role> --config cluster.toml`` reads the ``[<role>]`` table of
the file; flags given on the command line win over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from kvpool.sizes import format_size

T = TypeVar("T")


def load_settings(cls: type[T], section: str, config_path: str | None, flags: dict[str, Any]) -> T:
    """Build ``cls`` from defaults, then ``[section]`` of the TOML file, then flags.

    Flags whose value is None were not given. Unknown keys in the file are an
    error naming the key, so a typo never silently keeps a default.
    """
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    table = read_config(config_path).get(section, {}) if config_path else {}
    if not isinstance(table, dict):
        raise ValueError(f"--config: [{section}] in {config_path} must be a table")
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"--config: unknown setting {section}.{key} in {config_path}")
        values[name] = value
    for name, value in flags.items():
        if value is not None and name in known:
            values[name] = value
    return cls(**values)


def read_config(config_path: str) -> dict[str, Any]:
    """The whole TOML document of ``--config``, its tables by name."""
    path = Path(config_path)
    if not path.is_file():
        raise ValueError(f"--config: {path} is not a file")
    with path.open("rb") as fh:
        try:
            return tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config: {path}: {exc}") from exc


def add_setting_flags(parser: argparse.ArgumentParser, cls: type, skip: Iterable[str] = ()) -> None:
    """One ``--flag`` per field of ``cls`` declared with ``kvpool.core.setting.setting``.

    The flag's type comes from the field's annotation, its help and choices
    from the field, and its shown default from the field's default, so a
    setting is declared once. Every flag defaults to None ("not given"), so
    ``load_settings`` lets the TOML file fill what the command line left out.
    """
    hints = typing.get_type_hints(cls)
    skipped = set(skip)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta or not meta.get("flag", True) or f.name in skipped:
            continue
        kind = hints[f.name]
        if typing.get_origin(kind) is types.UnionType and type(None) in typing.get_args(kind):
            # "int | None": None means "not set here", the flag still takes an int
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": _help(f)}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            # sizes ("512MiB") and lists ("a:1,b:2") arrive as text; the settings class parses them
            kwargs["type"] = kind if kind in (int, float) else str
            if meta.get("choices"):
                kwargs["choices"] = list(meta["choices"])
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def _help(f: dataclasses.Field[Any]) -> str:
    shown = f.metadata.get("default_text")
    if shown is None:
        if f.default is not dataclasses.MISSING:
            value = f.default
            shown = format_size(value) if f.name.endswith("_bytes") and isinstance(value, int) else str(value)
            shown = shown if shown != "" else "none"
        else:
            shown = "computed"
    return f"{f.metadata['help']} (default: {shown})"
