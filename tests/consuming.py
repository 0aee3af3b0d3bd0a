"""Helpers to drive a Consumer in tests and read what it dead-lettered."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pipeline.consumer import Consumer
from pipeline.eventlog import EventLog
from pipeline.replay import replay
from pipeline.topology import DEADLETTER
from schemas import DeadLetter
from tests.servers import HANG_GUARD_S


async def run_until(consumer: Consumer, done: Callable[[], bool], timeout_s: float = HANG_GUARD_S) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    deadline = time.monotonic() + timeout_s
    try:
        while not done():
            if task.done():
                task.result()
                raise AssertionError("consumer stopped before the condition held")
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout_s}s; stats={consumer.stats}")
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=HANG_GUARD_S)


async def dead_letters(event_log: EventLog, run_id: str) -> list[DeadLetter]:
    found = []
    async for item in replay(event_log, DEADLETTER.name, DEADLETTER.run_filter(run_id)):
        assert isinstance(item.event, DeadLetter)
        found.append(item.event)
    return found
