"""Structured logging: key-value events, JSON when not on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog

from kvpool.tracing import add_trace_id

# the levels every command's --log-level takes
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    """Route structlog (and stdlib logging) to stderr.

    ``json=None`` picks JSON lines when stderr is not a terminal (production,
    containers, tests) and a readable console format on a terminal.
    """
    if json is None:
        json = not sys.stderr.isatty()
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r} is not one of debug, info, warning, error")
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(message)s")
    # the HTTP client logs every request at info: our own request logs say more, once
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_id,  # the trace of the span current where a line is written (kvpool.tracing)
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
