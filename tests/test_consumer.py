import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from infra.streams import ApplyReport, apply, apply_consumer
from pipeline.blobstore import S3BlobStore
from pipeline.config import LogSettings, StreamSettings
from pipeline.consumer import Consumer, Delivery, keepalive_interval_s
from pipeline.errors import AppendFailed, BlobStoreUnavailable, ConsumerNotDeclared, PoisonEvent, TransientError
from pipeline.eventlog import EventLog
from pipeline.topology import ConsumerRole, consumer_for
from tests.consuming import dead_letters, run_until
from tests.events import reward, trajectory
from tests.servers import HANG_GUARD_S, connection_env

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
    subject = f"rl.{settings.run_id}.traj.g0.{{}}"  # one message per subject: each on a trajectory's own
    garbage = await event_log.js.publish(subject.format("a"), b"\x00not an event")
    unknown = await event_log.js.publish(
        subject.format("b"), json.dumps({"type": "mystery.v1", "run_id": "x"}).encode()
    )
    invalid = await event_log.js.publish(
        subject.format("c"), json.dumps({"type": "trajectory.v1", "run_id": "x"}).encode()
    )
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
    assert letters[invalid.seq].error_class == "invalid" and "missing required field" in letters[invalid.seq].reason
    for letter, token in zip((letters[garbage.seq], letters[unknown.seq], letters[invalid.seq]), "abc", strict=True):
        assert letter.original_subject == subject.format(token)
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


async def test_a_bug_is_retried_bug_attempts_times_then_dead_lettered(event_log, settings):
    await event_log.append(trajectory(settings.run_id, "never-works", 3))

    async def handler(delivery: Delivery) -> None:
        raise RuntimeError("still broken")

    consumer = _consumer(event_log, settings, handler, retry_delays_s=(0.1,), bug_attempts=2)
    await run_until(consumer, lambda: consumer.stats.dead_lettered == 1)
    (letter,) = await dead_letters(event_log, settings.run_id)
    assert letter.num_delivered == 2 < settings.streams.max_deliver
    assert "gave up after 2 deliveries" in letter.reason and "still broken" in letter.reason
    assert letter.error_class == "RuntimeError"
    assert letter.stream == "trajectories" and letter.consumer == f"{settings.run_id}-rewards"
    assert consumer.stats.failing == 0


async def test_a_transient_failure_outlives_bug_attempts_and_is_dead_lettered_after_its_time(event_log, settings):
    """Transient failures are retried for `transient_retry_s`, not a handful of deliveries; then they end
    on the dead-letter stream with the count and the last error, never silently."""
    await event_log.append(trajectory(settings.run_id, "verifier-away", 3))
    calls = []

    async def handler(delivery: Delivery) -> None:
        calls.append(delivery.num_delivered)
        raise TransientError("the verifier service is away")

    consumer = _consumer(event_log, settings, handler, retry_delays_s=(0.1,), bug_attempts=1, transient_retry_s=0.5)
    await run_until(consumer, lambda: consumer.stats.dead_lettered == 1)
    (letter,) = await dead_letters(event_log, settings.run_id)
    assert len(calls) >= 2 and calls == list(range(1, len(calls) + 1))  # more than bug_attempts=1
    assert consumer.stats.transient_retries == len(calls) - 1
    assert letter.error_class == "TransientError" and "retried for 0.5s" in letter.reason
    assert "still failing after" in letter.reason and "the verifier service is away" in letter.reason


async def test_the_log_or_store_down_pauses_fetching_instead_of_burning_deliveries(event_log, settings):
    await event_log.append(trajectory(settings.run_id, "store-down", 3))
    await event_log.append(trajectory(settings.run_id, "behind-it", 3))
    calls: list[str] = []

    async def handler(delivery: Delivery) -> None:
        calls.append(delivery.event.trajectory_id)
        if calls.count("store-down") == 1 and delivery.event.trajectory_id == "store-down":
            raise BlobStoreUnavailable("http://127.0.0.1:1", "connection refused")

    consumer = _consumer(event_log, settings, handler, retry_delays_s=(0.5,), batch=1)
    await run_until(consumer, lambda: consumer.stats.acked == 2)
    assert consumer.stats.pauses == 1 and consumer.stats.transient_retries == 1
    assert sorted(calls) == ["behind-it", "store-down", "store-down"]
    assert await dead_letters(event_log, settings.run_id) == []


async def test_a_claim_check_into_another_bucket_is_dead_lettered_at_once(event_log, settings):
    """Refused before any GET (a forged pointer must not make readers fetch what it names); before, a
    missing bucket surfaced as a fatal BucketNotFound in whichever reader met it."""
    big = trajectory(settings.run_id, "big-lost-bucket", 20_000)
    result = await event_log.append(big)
    claim = json.loads((await event_log.js.get_msg("TRAJECTORIES", result.seq)).data)
    await event_log.js.delete_msg("TRAJECTORIES", result.seq)  # republished below, pointing elsewhere
    claim["uri"] = "s3://no-such-bucket-" + settings.run_id + "/" + claim["uri"].split("/", 3)[3]
    await event_log.js.publish(result.subject, json.dumps(claim).encode())
    consumer = _consumer(event_log, settings, _noop)
    await run_until(consumer, lambda: consumer.stats.dead_lettered == 1)
    (letter,) = await dead_letters(event_log, settings.run_id)
    assert letter.error_class == "claim_check_foreign"
    assert letter.num_delivered == 1 and "no-such-bucket" in letter.reason


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


@pytest.mark.parametrize(
    ("replacement", "error_class", "said"),
    [
        (lambda size: b"{}", "claim_check_corrupt", lambda claim: claim["sha256"]),
        # Far larger than its claim: not read past the claimed size (a swapped blob could be any size).
        (lambda size: os.urandom(4 * size), "claim_check_oversized", lambda claim: f"more than the {claim['bytes']}"),
    ],
    ids=["corrupt", "larger"],
)
async def test_a_claim_blob_replaced_in_the_store_is_dead_lettered(event_log, settings, replacement, error_class, said):
    big = trajectory(settings.run_id, "big-replaced", 20_000)
    result = await event_log.append(big)
    claim = json.loads((await event_log.js.get_msg("TRAJECTORIES", result.seq)).data)
    blobs = S3BlobStore(settings.blobs)
    bucket, key = claim["uri"].removeprefix("s3://").split("/", 1)
    body = replacement(claim["bytes"])
    blobs.client.put_object(Bucket=bucket, Key=key, Body=body, Metadata={"sprawl-sha256": claim["sha256"]})
    consumer = _consumer(event_log, settings, _noop)
    await run_until(consumer, lambda: consumer.stats.dead_lettered == 1)
    (letter,) = await dead_letters(event_log, settings.run_id)
    assert letter.error_class == error_class
    assert said(claim) in letter.reason


async def test_a_claim_larger_than_the_cap_is_dead_lettered_before_any_get(event_log, settings):
    """Any sampler may write claims: one that says it holds 300 GiB must not make every reader try."""
    big = trajectory(settings.run_id, "big-forged-size", 20_000)
    result = await event_log.append(big)
    claim = json.loads((await event_log.js.get_msg("TRAJECTORIES", result.seq)).data)
    await event_log.js.delete_msg("TRAJECTORIES", result.seq)  # republished below, claiming more
    claim["bytes"] = 300 << 30
    claim["uri"] += "-never-stored"  # had it been fetched, this would be claim_check_missing
    await event_log.js.publish(result.subject, json.dumps(claim).encode())
    consumer = _consumer(event_log, settings, _noop)
    await run_until(consumer, lambda: consumer.stats.dead_lettered == 1)
    (letter,) = await dead_letters(event_log, settings.run_id)
    assert letter.error_class == "claim_check_oversized" and letter.num_delivered == 1
    assert f"above log.max_claim_bytes={settings.log.max_claim_bytes}" in letter.reason


async def test_an_event_above_the_claim_cap_is_refused_at_append_and_nothing_is_stored(settings):
    capped = settings.model_copy(update={"log": settings.log.model_copy(update={"max_claim_bytes": 300_000})})
    event_log = await EventLog.connect(capped, worker="test-claim-cap")
    try:
        await apply(event_log.js, settings.streams, settings.run_id)
        with pytest.raises(AppendFailed, match=r"above log\.max_claim_bytes=300000"):
            await event_log.append(trajectory(settings.run_id, "too-big", 200_000))
        info = await event_log.js.stream_info("TRAJECTORIES", subjects_filter=f"rl.{settings.run_id}.>")
        assert not info.state.subjects  # nothing appended for this run
        assert S3BlobStore(settings.blobs).list_keys(f"claims/{settings.run_id}/") == []  # nor uploaded
    finally:
        await event_log.close()


def test_the_claim_cap_must_be_above_the_claim_check_threshold():
    with pytest.raises(ValueError, match="not above claim_check_threshold_bytes"):
        LogSettings(claim_check_threshold_bytes=1 << 20, max_claim_bytes=1 << 20)


async def test_a_consumer_of_the_rewards_stream_gets_rewards(event_log, settings):
    await event_log.append(trajectory(settings.run_id, "not-a-reward", 3))
    await event_log.append(reward(settings.run_id, 1))
    got = []

    async def handler(delivery: Delivery) -> None:
        got.append(type(delivery.event).__name__)

    # The archiver's consumer of REWARDS: declared by infra for every run, bound here like any worker's.
    consumer = Consumer(event_log, "REWARDS", f"{settings.run_id}-archiver-rewards", handler, fetch_timeout_s=0.2)
    await run_until(consumer, lambda: got == ["Reward"])


async def test_a_killed_workers_message_returns_after_the_default_ack_wait(event_log, settings, tmp_path):
    """With the default stream settings a SIGKILLed worker's in-flight message is redelivered after the
    first backoff (10 s), not the 30-300 s it took before, and its keepalive interval fits well inside it."""
    defaults = StreamSettings()
    rewards = consumer_for(settings.run_id, ConsumerRole.REWARDS)
    await apply_consumer(event_log.js, rewards, defaults, ApplyReport())
    declared = (await event_log.js.consumer_info(rewards.stream.name, rewards.name)).config
    assert declared.ack_wait == defaults.backoff_s[0] <= 10.0
    assert declared.max_deliver == defaults.max_deliver
    events = [trajectory(settings.run_id, f"k{n}", 3) for n in range(3)]
    for event in events:
        await event_log.append(event)
    env = {
        **os.environ,
        "SPRAWL_RUN_ID": settings.run_id,
        **connection_env(settings, "admin"),
    }
    cmd = [sys.executable, "-m", "tests.ledger_consumer", "--workdir", str(tmp_path)]
    victim = subprocess.Popen([*cmd, "--hang-on", "k1"], env=env)
    try:
        while not (tmp_path / "hanging").exists():
            assert victim.poll() is None, "the victim exited before it hung"
            await asyncio.sleep(0.05)
        victim.send_signal(signal.SIGKILL)  # k1 applied, not acked
        victim.wait(timeout=HANG_GUARD_S)
    finally:
        if victim.poll() is None:
            victim.kill()
    survivor = subprocess.Popen(cmd, env=env)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            info = await event_log.js.consumer_info(rewards.stream.name, rewards.name)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                break
            assert time.monotonic() < deadline, "the survivor did not drain the consumer"
            await asyncio.sleep(0.1)
    finally:
        survivor.send_signal(signal.SIGTERM)
        survivor.wait(timeout=HANG_GUARD_S)
    invocations = (tmp_path / "invocations").read_text().split()
    applied = (tmp_path / "applied").read_text().split()
    assert invocations.count(events[1].event_id) == 2, "k1 came back to the survivor"
    assert sorted(applied) == sorted(e.event_id for e in events)  # applied once each
    assert await dead_letters(event_log, settings.run_id) == []


def test_the_keepalive_of_a_handler_fits_inside_the_default_ack_wait():
    defaults = StreamSettings()
    first_wait = min([defaults.ack_wait_s, *defaults.backoff_s])
    assert first_wait <= 10.0
    assert keepalive_interval_s(defaults.ack_wait_s, defaults.backoff_s) <= first_wait / 3
