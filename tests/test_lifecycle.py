"""A worker's parts live and die together: a background part that fails stops the worker loudly."""

import asyncio
import contextlib

import pytest

from pipeline.errors import SprawlError
from workers.lifecycle import raise_if_cancelled, run_beside


async def _work(stop: asyncio.Event, finished: list[str]) -> None:
    await stop.wait()
    finished.append("drained")  # what was in hand is finished before the error surfaces


async def test_a_failing_helper_stops_the_work_and_raises_its_error():
    stop, finished = asyncio.Event(), []

    async def heartbeat() -> None:
        await asyncio.sleep(0)
        raise OSError("the heartbeat's socket broke")

    with pytest.raises(OSError, match="socket broke"):
        await run_beside(_work(stop, finished), asyncio.create_task(heartbeat()), stop, "the heartbeat")
    assert stop.is_set() and finished == ["drained"]


async def test_a_helper_that_returns_is_a_failure_too():
    stop, finished = asyncio.Event(), []

    async def projection() -> None:
        return None

    with pytest.raises(SprawlError, match="the prompt projection ended"):
        await run_beside(_work(stop, finished), asyncio.create_task(projection()), stop, "the prompt projection")
    assert finished == ["drained"]


async def test_the_helper_is_cancelled_when_the_work_ends():
    stop = asyncio.Event()
    helper = asyncio.create_task(asyncio.Event().wait())
    stop.set()
    await run_beside(_work(stop, []), helper, stop, "the helper")
    assert helper.cancelled()


async def test_a_helper_that_ends_because_the_worker_stops_is_no_failure():
    stop, finished = asyncio.Event(), []

    async def projection() -> None:
        await stop.wait()  # like a tail that follows the log until stop

    helper = asyncio.create_task(projection())
    stop.set()
    await run_beside(_work(stop, finished), helper, stop, "the prompt projection")
    assert finished == ["drained"]


async def _request_like_nats_py() -> None:
    """What nats-py's request does when cancelled mid-flight: it answers with a timeout."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        raise TimeoutError from None


async def test_a_loop_that_retries_timeouts_still_ends_when_cancelled():
    """Before: a heartbeat loop swallowed the timeout its cancellation became and ran on, so the
    sampler's shutdown waited for it forever (seen with four suites on two cores)."""
    rounds = []

    async def heartbeats() -> None:
        while True:
            raise_if_cancelled()
            rounds.append(1)
            with contextlib.suppress(TimeoutError):  # "retry later"
                await _request_like_nats_py()

    task = asyncio.create_task(heartbeats())
    while not rounds:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(rounds) == 1
