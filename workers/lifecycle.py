"""How a worker process lives: connected to the log, stopped by a signal, closed on the way out, and
never alive with a dead part: a background part that ends takes the process down with one line."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from pipeline.errors import WorkerPartFailed
from pipeline.eventlog import EventLog

T = TypeVar("T")


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
    # A revoked or expired identity ends the worker with one line, instead of a process that reconnects
    # forever with credentials that can never work again.
    watch = asyncio.create_task(event_log.wait_identity_refused())
    try:
        await run_beside(body(event_log, stop), watch, stop, "the connection to the log")
    finally:
        await event_log.close()


async def run_beside(work: Awaitable[None], helper: asyncio.Task, stop: asyncio.Event, what: str) -> None:
    """Run `work` (which returns once `stop` is set) beside `helper`, a task meant to live as long as it.

    A helper that ends first, before `stop`, has failed: the work is stopped (it finishes what is in
    hand) and WorkerPartFailed naming `what` is raised (its cause: the helper's error), so the process
    exits non-zero with one line instead of living on with a dead part. A helper that ends because
    `stop` was set is fine, unless it ended with an error.
    """
    working = asyncio.ensure_future(work)
    try:
        await asyncio.wait({working, helper}, return_when=asyncio.FIRST_COMPLETED)
        if helper.done():
            stopping = stop.is_set()  # a helper may end because the worker is stopping: that is no failure
            stop.set()
            await working
            if not helper.cancelled() and (error := helper.exception()) is not None:
                if isinstance(error, WorkerPartFailed):  # the helper already names the part that failed
                    raise error
                raise WorkerPartFailed(what, error) from error
            if not stopping:
                raise WorkerPartFailed(what, None)
        await working
    finally:
        await _cancelled(helper)


async def first_to_end(parts: Iterable[asyncio.Task]) -> None:
    """Wait until one of `parts` (tasks meant to live as long as their worker) ends: a helper for
    `run_beside` that watches several parts. One that failed raises WorkerPartFailed naming it by its task
    name; one that just ended returns, and `run_beside` judges that by whether the worker is stopping."""
    parts = list(parts)
    done, _ = await asyncio.wait(parts, return_when=asyncio.FIRST_COMPLETED)
    ended = next(iter(done))
    if not ended.cancelled() and (error := ended.exception()) is not None:
        raise WorkerPartFailed(ended.get_name(), error) from error


async def run_guarded(work: Awaitable[T], guards: Iterable[asyncio.Task]) -> T:
    """Run `work` while every guard lives: background parts (a feed, the lease) named by their task
    names, none of which may end while the work runs.

    A guard that ends first has failed, and the work is cancelled at once rather than drained: what a
    worker does after losing its lease or its input must not reach the log. WorkerPartFailed naming
    the guard is raised (its cause: the guard's error). The guards are left running when the work
    returns; their owner cancels them.
    """
    working = asyncio.ensure_future(work)
    guards = list(guards)
    try:
        await asyncio.wait({working, *guards}, return_when=asyncio.FIRST_COMPLETED)
        if not working.done():
            failed = next(g for g in guards if g.done())
            await _cancelled(working)
            error = None if failed.cancelled() else failed.exception()
            raise WorkerPartFailed(failed.get_name(), error) from error
        return working.result()
    finally:
        await _cancelled(working)


async def _cancelled(task: asyncio.Future) -> None:
    """Cancel `task` (if it still runs) and wait for it to end, whatever it ends with."""
    if task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def end_guards(guards: Iterable[asyncio.Task]) -> None:
    """Cancel the guards that still run and wait for all of them. A guard's error was raised already
    (by `run_guarded`, as WorkerPartFailed), or the work's own error is on its way out: it is not
    raised again here, so it cannot replace the error that says why the worker stops."""
    guards = list(guards)
    for guard in guards:
        guard.cancel()
    for guard in guards:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await guard
