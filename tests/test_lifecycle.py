"""A worker's parts live and die together: a background part that fails stops the worker loudly."""

import asyncio
import contextlib

import pytest

from pipeline.errors import LogUnavailable, WorkerPartFailed
from workers.lifecycle import first_to_end, raise_if_cancelled, run_beside, run_guarded


async def _work(stop: asyncio.Event, finished: list[str]) -> None:
    await stop.wait()
    finished.append("drained")  # what was in hand is finished before the error surfaces


async def test_a_failing_helper_stops_the_work_and_raises_its_error():
    stop, finished = asyncio.Event(), []

    async def heartbeat() -> None:
        await asyncio.sleep(0)
        raise OSError("the heartbeat's socket broke")

    with pytest.raises(WorkerPartFailed, match="the heartbeat failed: OSError: the heartbeat's socket broke") as failed:
        await run_beside(_work(stop, finished), asyncio.create_task(heartbeat()), stop, "the heartbeat")
    assert isinstance(failed.value.__cause__, OSError)
    assert stop.is_set() and finished == ["drained"]


async def test_a_helper_that_returns_is_a_failure_too():
    stop, finished = asyncio.Event(), []

    async def projection() -> None:
        return None

    with pytest.raises(WorkerPartFailed, match="the prompt projection ended"):
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


async def test_a_guard_that_fails_cancels_the_work_at_once_and_names_itself():
    """The trainer's lease and feeds: what the work would do after losing them must not happen."""
    reached = []

    async def training() -> None:
        await asyncio.Event().wait()  # an update in progress
        reached.append("published")

    async def feed() -> None:
        await asyncio.sleep(0)
        raise LogUnavailable("following rl.r.traj.>", "connection closed")

    lease = asyncio.create_task(asyncio.Event().wait(), name="the trainer's lease")
    guards = [lease, asyncio.create_task(feed(), name="the trainer's trajectory feed")]
    with pytest.raises(
        WorkerPartFailed, match="the trainer's trajectory feed failed: the log did not answer"
    ) as failed:
        await run_guarded(training(), guards)
    assert isinstance(failed.value.__cause__, LogUnavailable)
    assert reached == [] and not lease.done()  # the owner cancels the surviving guards
    lease.cancel()


async def test_a_guard_that_returns_is_a_failure_and_the_work_result_passes_through():
    async def returns() -> None:
        return None

    with pytest.raises(WorkerPartFailed, match="the reward feed ended while the worker was running"):
        await run_guarded(asyncio.Event().wait(), [asyncio.create_task(returns(), name="the reward feed")])

    async def work() -> int:
        return 7

    guard = asyncio.create_task(asyncio.Event().wait(), name="the lease")
    assert await run_guarded(work(), [guard]) == 7
    assert not guard.done()
    guard.cancel()


async def test_the_work_s_own_error_propagates_unwrapped():
    async def work() -> None:
        raise ValueError("a bug in the update")

    guard = asyncio.create_task(asyncio.Event().wait(), name="the lease")
    with pytest.raises(ValueError, match="a bug in the update"):
        await run_guarded(work(), [guard])
    guard.cancel()


async def test_the_first_of_several_parts_to_fail_is_named():
    """The sampler watches its heartbeat loop and the island's chain follower: either failing ends it."""
    stop, finished = asyncio.Event(), []

    async def beating() -> None:
        await asyncio.Event().wait()

    async def following() -> None:
        await asyncio.sleep(0)
        raise OSError("the store went away for good")

    beats = asyncio.create_task(beating(), name="the heartbeat loop")
    follower = asyncio.create_task(following(), name="the chain follower")
    watch = asyncio.create_task(first_to_end([beats, follower]))
    with pytest.raises(WorkerPartFailed, match="the chain follower failed: OSError: the store went away"):
        await run_beside(_work(stop, finished), watch, stop, "a background part")
    assert finished == ["drained"]
    beats.cancel()


async def test_a_part_that_ends_while_the_worker_stops_is_no_failure():
    stop, finished = asyncio.Event(), []

    async def until_stopped() -> None:
        await stop.wait()

    part = asyncio.create_task(until_stopped(), name="the heartbeat loop")
    watch = asyncio.create_task(first_to_end([part]))
    stop.set()
    await run_beside(_work(stop, finished), watch, stop, "a background part")
    assert finished == ["drained"]
