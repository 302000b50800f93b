"""The flags the tool commands share, declared once: ``--json``, ``--quick`` and ``--log-level``."""

from __future__ import annotations

import argparse

from kvpool.logs import LOG_LEVELS


def add_report_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, quick: str | None = None,
                     log_level: bool = True) -> None:
    """``--json``; ``--quick`` with its own help when given; ``--log-level`` (default warning) unless told not."""
    parser.add_argument("--json", action="store_true", help="the last line of output is one JSON object")
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    if log_level:
        add_log_level_flag(parser, "warning")


def add_log_level_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str) -> None:
    parser.add_argument("--log-level", default=default, choices=LOG_LEVELS)
