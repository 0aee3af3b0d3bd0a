"""How a worker process lives: connected to the log, stopped by a signal, closed on the way out."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from pipeline.eventlog import EventLog


def stop_on_signals(*signals: signal.Signals) -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (plus `signals`): workers finish what is in hand and return."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, *signals):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def run_connected(settings, worker: str, body: Callable[[EventLog, asyncio.Event], Awaitable[None]]) -> None:
    """Connect to the log as `worker`, run `body(log, stop)` until it returns, close the connection."""
    event_log = await EventLog.connect(settings, worker=worker)
    stop = stop_on_signals()
    try:
        await body(event_log, stop)
    finally:
        await event_log.close()
