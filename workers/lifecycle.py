"""How a worker process lives: connected to the log, stopped by a signal, closed on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable

from pipeline.errors import SprawlError
from pipeline.eventlog import EventLog


def stop_on_signals(*signals: signal.Signals) -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (plus `signals`): workers finish what is in hand and return."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, *signals):
        loop.add_signal_handler(sig, stop.set)
    return stop


def raise_if_cancelled() -> None:
    """Re-raise a cancellation that a library turned into something else.

    nats-py answers a cancellation that lands inside a request with a timeout; a loop that retries
    timeouts would swallow it and run forever, and whoever awaits the cancelled task hangs. Loops
    that catch timeouts call this where they would go round again.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def run_connected(settings, worker: str, body: Callable[[EventLog, asyncio.Event], Awaitable[None]]) -> None:
    """Connect to the log as `worker`, run `body(log, stop)` until it returns, close the connection."""
    event_log = await EventLog.connect(settings, worker=worker)
    stop = stop_on_signals()
    try:
        await body(event_log, stop)
    finally:
        await event_log.close()


async def run_beside(work: Awaitable[None], helper: asyncio.Task, stop: asyncio.Event, what: str) -> None:
    """Run `work` (which returns once `stop` is set) beside `helper`, a task meant to live as long as it.

    A helper that ends first, before `stop`, has failed: the work is stopped (it finishes what is in
    hand) and the helper's error is raised, so the process exits non-zero instead of living on with
    a dead part. A helper that ends because `stop` was set is fine, unless it ended with an error.
    """
    working = asyncio.ensure_future(work)
    try:
        await asyncio.wait({working, helper}, return_when=asyncio.FIRST_COMPLETED)
        if helper.done():
            stopping = stop.is_set()  # a helper may end because the worker is stopping: that is no failure
            stop.set()
            await working
            if not helper.cancelled() and (error := helper.exception()) is not None:
                raise error
            if not stopping:
                raise SprawlError(f"{what} ended while the worker was running", hint="see the log lines before it")
        await working
    finally:
        if not helper.done():
            helper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await helper
