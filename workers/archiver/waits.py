"""Waiting out what did not answer, visibly: retries with backoff, a status line, counters.

A transient failure (the object store unreachable or answering 5xx, the log reconnecting) is not an
error of the data, so the archiver retries the same operation, holding the messages it concerns
unacked. While a state lasts, every retry logs one structured line naming the state, the stream,
how long it has lasted and how many attempts it took so far; a line says when it ended. The
counters (`retries` by state, `waiting` now) are the process's to expose. Past `give_up_after_s`
the error is raised, and the process exits for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

from pipeline.logs import get_logger
from workers.archiver.settings import ArchiveSection

log = get_logger(__name__)

T = TypeVar("T")


class WaitState(StrEnum):
    """What a stream archiver is waiting out."""

    S3_UNAVAILABLE = "s3_unavailable"
    """A Parquet PUT or a claim-check GET did not get through; the buffer stays unacked."""
    LOG_UNAVAILABLE = "log_unavailable"
    """NATS did not answer a fetch or an append (reconnecting, stalled, restarting)."""


class Abandoned(Exception):
    """The archiver is stopping while waiting: the operation was given up, nothing was acked."""


@dataclass
class Waits:
    """What the archiver is waiting out now, and how often it retried: the process's status."""

    settings: ArchiveSection
    retries: Counter[str] = field(default_factory=Counter)
    """Retries so far, by state (a counter: it only grows)."""
    waiting: dict[tuple[str, str], float] = field(default_factory=dict)
    """(stream label, state) -> monotonic time the state began, for the states lasting now."""

    async def until_done(
        self,
        attempt: Callable[[], Awaitable[T]],
        *,
        stream: str,
        state: WaitState,
        transient: tuple[type[BaseException], ...],
        stop: asyncio.Event,
    ) -> T:
        """`attempt()`'s result, retrying it with backoff while it raises one of `transient`.

        Raises Abandoned when `stop` is set while waiting (the caller acks nothing), and the last
        error once the state has lasted `give_up_after_s`."""
        delay = self.settings.retry_first_s
        attempts = 0
        began: float | None = None
        while True:
            try:
                result = await attempt()
            except transient as exc:
                attempts += 1
                now = time.monotonic()
                began = began if began is not None else now
                self.waiting[(stream, state)] = began
                self.retries[state] += 1
                lasted = now - began
                limit = self.settings.give_up_after_s
                if limit is not None and lasted >= limit:
                    log.error("giving up", state=state, stream=stream, lasted_s=round(lasted, 1), attempts=attempts)
                    self.waiting.pop((stream, state), None)
                    raise
                log.warning(
                    "waiting",
                    state=state,
                    stream=stream,
                    lasted_s=round(lasted, 1),
                    attempts=attempts,
                    retry_in_s=delay,
                    error=str(exc) or type(exc).__name__,
                )
                if stop.is_set() or await _stopped_within(stop, delay):
                    self.waiting.pop((stream, state), None)
                    raise Abandoned(f"stopped while waiting ({state})") from exc
                delay = min(delay * 2, self.settings.retry_max_s)
                continue
            if began is not None:
                self.waiting.pop((stream, state), None)
                lasted = round(time.monotonic() - began, 1)
                log.warning("recovered", state=state, stream=stream, lasted_s=lasted, attempts=attempts)
            return result


async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True
