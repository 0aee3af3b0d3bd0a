"""structlog setup: JSON lines by default, pretty on a TTY; `run_id` always bound."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Literal

import structlog

LogFormat = Literal["auto", "json", "console"]


class _CurrentStderr:
    """Whatever `sys.stderr` is at each write. Test runners and daemons swap it; a logger that kept
    the stream of the moment it was configured writes into a closed file later."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


class _QuietTlsEof(logging.Filter):
    """asyncio warns "returning true from eof_received() has no effect when using ssl" every time a TLS
    connection of nats-py closes (its protocol keeps the transport half-open, which TLS cannot): noise,
    once per connection, that would bury real warnings in every worker's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_QuietTlsEof())


def configure_logging(run_id: str, fmt: LogFormat = "auto", level: str = "INFO", file: Path | None = None) -> None:
    """Logs go to stderr, or appended to `file` (when the terminal belongs to a live view)."""
    stream = file.open("a", buffering=1) if file is not None else _CurrentStderr()
    use_console = fmt == "console" or (fmt == "auto" and stream.isatty())
    renderer = structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(run_id=run_id)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(component=name)
