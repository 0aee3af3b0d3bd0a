import asyncio
import json
import time

import pytest

from pipeline.blobstore import S3BlobStore
from pipeline.consumer import Consumer, Delivery
from pipeline.errors import ConsumerNotDeclared, PoisonEvent, TransientError
from tests.consuming import dead_letters, run_until
from tests.events import reward, trajectory

pytestmark = pytest.mark.integration


def _consumer(event_log, settings, handler, **kwargs) -> Consumer:
    return Consumer(event_log, "TRAJECTORIES", f"{settings.run_id}-rewards", handler, fetch_timeout_s=0.2, **kwargs)


async def test_binding_an_undeclared_consumer_fails_with_the_fix(event_log):
    consumer = Consumer(event_log, "TRAJECTORIES", "nobody-declared-me", _noop)
    with pytest.raises(ConsumerNotDeclared, match="sprawl infra apply"):
        await consumer.bind()


async def _noop(delivery: Delivery) -> None:
    return None


async def test_poison_messages_are_dead_lettered_with_reason_and_the_stream_moves_on(event_log, settings):
    subject = f"rl.{settings.run_id}.traj.g0"
    garbage = await event_log.js.publish(subject, b"\x00not an event")
    unknown = await event_log.js.publish(subject, json.dumps({"type": "mystery.v1", "run_id": "x"}).encode())
    invalid = await event_log.js.publish(subject, json.dumps({"type": "trajectory.v1", "run_id": "x"}).encode())
    good = trajectory(settings.run_id, "after-the-poison", 3)
    await event_log.append(good)
    handled: list[str] = []

    async def handler(delivery: Delivery) -> None:
        handled.append(delivery.event.trajectory_id)

    consumer = _consumer(event_log, settings, handler)
    await run_until(consumer, lambda: handled == ["after-the-poison"] and consumer.stats.dead_lettered == 3)
    letters = {d.original_seq: d for d in await dead_letters(event_log, settings.run_id)}
    assert letters[garbage.seq].error_class == "malformed"
    assert letters[garbage.seq].payload == b"\x00not an event"
    assert letters[unknown.seq].error_class == "unknown_type" and "mystery.v1" in letters[unknown.seq].reason
    assert letters[invalid.seq].error_class == "invalid" and "trajectory_id" in letters[invalid.seq].reason
    for letter in letters.values():
        assert letter.original_subject == subject
        assert letter.consumer == f"{settings.run_id}-rewards"
        assert letter.stream == "trajectories"


async def test_handler_poison_is_dead_lettered_without_retries(event_log, settings):
    await event_log.append(trajectory(settings.run_id, "bad-task", 3))
    calls = []

    async def handler(delivery: Delivery) -> None:
        calls.append(delivery.num_delivered)
        raise PoisonEvent("task 'arith' has no verifier", error_class="no_verifier")

    consumer = _consumer(event_log, settings, handler)
    await run_until(consumer, lambda: consumer.stats.dead_lettered == 1)
    (letter,) = await dead_letters(event_log, settings.run_id)
    assert letter.error_class == "no_verifier" and "no verifier" in letter.reason
    assert calls == [1]


async def test_transient_errors_are_retried_then_succeed(event_log, settings):
    await event_log.append(trajectory(settings.run_id, "flaky", 3))
    calls = []

    async def handler(delivery: Delivery) -> None:
        calls.append(delivery.num_delivered)
        if len(calls) < 3:
            raise ConnectionError("the verifier service blinked")

    consumer = _consumer(event_log, settings, handler, retry_delays_s=(0.1,))
    await run_until(consumer, lambda: consumer.stats.acked == 1)
    assert calls == [1, 2, 3]
    assert consumer.stats.nacked == 2
    assert await dead_letters(event_log, settings.run_id) == []


async def test_a_transient_error_is_retried_no_sooner_than_it_asks(event_log, settings):
    await event_log.append(trajectory(settings.run_id, "not-yet", 3))
    seen: list[float] = []

    async def handler(delivery: Delivery) -> None:
        seen.append(time.monotonic())
        if len(seen) == 1:
            raise TransientError("prompt group not seen yet", retry_after_s=1.5)

    consumer = _consumer(event_log, settings, handler, retry_delays_s=(0.1,))
    await run_until(consumer, lambda: consumer.stats.acked == 1)
    assert len(seen) == 2 and seen[1] - seen[0] >= 1.5
    assert consumer.stats.nacked == 1
    assert await dead_letters(event_log, settings.run_id) == []


async def test_exhausted_retries_are_dead_lettered(event_log, settings):
    await event_log.append(trajectory(settings.run_id, "never-works", 3))

    async def handler(delivery: Delivery) -> None:
        raise RuntimeError("still broken")

    consumer = _consumer(event_log, settings, handler, retry_delays_s=(0.1,))
    await run_until(consumer, lambda: consumer.stats.dead_lettered == 1)
    (letter,) = await dead_letters(event_log, settings.run_id)
    assert letter.num_delivered == settings.streams.max_deliver
    assert "gave up after 4 deliveries" in letter.reason and "still broken" in letter.reason
    assert letter.error_class == "RuntimeError"


async def test_long_handler_keeps_its_message_with_in_progress(event_log, settings):
    await event_log.append(trajectory(settings.run_id, "slow", 3))
    deliveries = []

    async def handler(delivery: Delivery) -> None:
        deliveries.append(delivery.num_delivered)
        await asyncio.sleep(3 * settings.streams.backoff_s[0])  # well past the ack wait

    consumer = _consumer(event_log, settings, handler)
    await run_until(consumer, lambda: consumer.stats.acked == 1)
    await asyncio.sleep(settings.streams.backoff_s[0] + 0.5)
    info = await event_log.js.consumer_info("TRAJECTORIES", f"{settings.run_id}-rewards")
    assert deliveries == [1]
    assert info.num_redelivered == 0 and info.num_ack_pending == 0


async def test_corrupt_claim_check_is_dead_lettered(event_log, settings):
    big = trajectory(settings.run_id, "big-corrupt", 20_000)
    result = await event_log.append(big)
    claim = json.loads((await event_log.js.get_msg("TRAJECTORIES", result.seq)).data)
    blobs = S3BlobStore(settings.blobs)
    bucket, key = claim["uri"].removeprefix("s3://").split("/", 1)
    blobs.client.put_object(Bucket=bucket, Key=key, Body=b"{}", Metadata={"sprawl-sha256": claim["sha256"]})
    consumer = _consumer(event_log, settings, _noop)
    await run_until(consumer, lambda: consumer.stats.dead_lettered == 1)
    (letter,) = await dead_letters(event_log, settings.run_id)
    assert letter.error_class == "claim_check_corrupt"
    assert claim["sha256"] in letter.reason


async def test_a_consumer_of_the_rewards_stream_gets_rewards(event_log, settings):
    await event_log.append(trajectory(settings.run_id, "not-a-reward", 3))
    await event_log.append(reward(settings.run_id, 1))
    got = []

    async def handler(delivery: Delivery) -> None:
        got.append(type(delivery.event).__name__)

    # The archiver's consumer of REWARDS: declared by infra for every run, bound here like any worker's.
    consumer = Consumer(event_log, "REWARDS", f"{settings.run_id}-archiver-rewards", handler, fetch_timeout_s=0.2)
    await run_until(consumer, lambda: got == ["Reward"])
