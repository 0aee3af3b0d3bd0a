"""Long-lived readers under a nats-server restart and a 60 s outage: the trainer's feeds and the reward
worker wait, say so, and resume by themselves; no group is lost or trained twice, no reward doubled.
A feed that dies, or a lease that cannot be renewed, stops the trainer instead."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from infra import stack
from infra.streams import apply
from pipeline.blobstore import S3BlobStore
from pipeline.errors import WorkerPartFailed
from pipeline.eventlog import EventLog
from pipeline.lease import LeaseLost
from pipeline.log_lookup import count_subjects
from pipeline.logs import configure_logging
from pipeline.replay import Follower, replay
from pipeline.topology import DEADLETTER, METRICS, PROMPTS, REWARDS, TRAINER, TRAJECTORIES, follower_name
from pipeline.version_log import fetch_version
from schemas import PromptGroup, TrainerMetrics
from tests.chain_helpers import signed_trust
from tests.events import trajectory
from tests.servers import HANG_GUARD_S, connection_env, restartable_stack
from tests.test_stalled_log import nats_stalled
from tests.trainer_data import GROUP_SIZE, make_groups, write_initial_model
from workers.rewards.worker import RewardSettings, RewardWorker
from workers.trainer.loop import Trainer
from workers.trainer.settings import TrainerSection, TrainerSettings

pytestmark = pytest.mark.integration

OUTAGE_S = 60.0
"""The outage the issue names: the server is away this long, then started again from its store."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_model(tmp_path_factory.mktemp("initial"))


@pytest.fixture
def own_stack(tmp_path):
    """A stack whose nats-server (both its ports fixed) is killed and started again."""
    with restartable_stack(tmp_path, monitor_port_fixed=True) as settings:
        yield settings


def _kill_nats(settings) -> None:
    """SIGKILL the stack's nats-server and wait until it is reaped (a dying process loses its command
    line before it closes its sockets, so only the reaped one has surely let go of its port)."""
    record = next(s for s in stack.status(settings).servers if s.name == "nats")
    os.kill(record.pid, signal.SIGKILL)
    try:
        os.waitpid(record.pid, 0)  # our child: stack.up started it
    except ChildProcessError:  # someone else's: gone once /proc forgets it
        deadline = time.monotonic() + HANG_GUARD_S
        while os.path.exists(f"/proc/{record.pid}"):
            assert time.monotonic() < deadline, "nats-server survived SIGKILL"
            time.sleep(0.05)
    assert [s.name for s in stack.dead_servers(settings)] == ["nats"]


def _start_nats_again(settings) -> None:
    """`stack up` repairs the half-dead stack: nats-server again on its ports, from its store."""
    repaired = stack.up(settings)
    assert any(a.startswith("restarted nats-server") for a in repaired.actions), repaired.actions


async def _until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not await condition():
        assert time.monotonic() < deadline, f"hang guard: {what}"
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------- the follower on its own


async def test_a_follower_re_creates_a_lost_consumer_from_its_position(event_log, settings):
    """A consumer the server no longer has (deleted here; gone with a restart in the tests below) is
    created again from the reader's position: every message once, in order."""
    run = settings.run_id
    name = follower_name(run, "test", TRAJECTORIES)
    follower = Follower(event_log, TRAJECTORIES.name, f"rl.{run}.traj.>", 1, name, idle_timeout_s=0.2)
    stop = asyncio.Event()
    seen: list[str] = []

    async def read() -> None:
        async for item in follower.events(stop):
            seen.append(item.event.trajectory_id)

    reader = asyncio.create_task(read())
    try:
        for n in range(3):
            await event_log.append(trajectory(run, f"before-{n}", 3))

        async def three() -> bool:
            assert not reader.done(), reader
            return len(seen) == 3

        await _until(three, "the first three trajectories")
        await event_log.js.delete_consumer(TRAJECTORIES.name, name)
        for n in range(3):
            await event_log.append(trajectory(run, f"after-{n}", 3))

        async def six() -> bool:
            assert not reader.done(), reader
            return len(seen) == 6

        await _until(six, "the three after the deletion")
    finally:
        stop.set()
        await asyncio.wait_for(reader, HANG_GUARD_S)
    assert seen == [f"before-{n}" for n in range(3)] + [f"after-{n}" for n in range(3)]
    assert follower.recreated == 1
    with pytest.raises(Exception, match="not found"):  # the reader deletes its consumer when done
        await event_log.js.consumer_info(TRAJECTORIES.name, name)


# ---------------------------------------------------------------- the workers through a restart and an outage


def _prompt_group(run: str, group: str) -> PromptGroup:
    return PromptGroup(
        run_id=run, group_id=group, task="synthetic", prompt="p", prompt_token_ids=[1], n_samples=GROUP_SIZE, answer="5"
    )


def _outage_warnings(text: str) -> list[dict]:
    lines = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event", "").startswith("the log does not answer"):
                lines.append(record)
    return lines


async def test_trainer_and_reward_worker_resume_after_a_restart_and_a_60s_outage(own_stack, model_dir, capsys):
    settings = own_stack
    run = settings.run_id
    configure_logging("tests", fmt="json", level="WARNING")  # as the session stack does: JSON lines on stderr
    event_log = await EventLog.connect(settings, worker="test-outage")
    await apply(event_log.js, settings.streams, run)
    groups = make_groups(model_dir, run, 6)
    for n in range(6):
        await event_log.append(_prompt_group(run, f"g{n}"))
    shared = settings.model_dump(include={"run_id", "nats", "blobs", "log", "streams"})
    worker = RewardWorker(RewardSettings(**shared, routes={"synthetic": "exact"}), event_log, None)
    # A lease that outlives the outage: this test is about the feeds (the lease's own limit is tested below).
    section = TrainerSection(
        model_dir=model_dir, groups_per_batch=1, trainer_id="t-outage", max_versions=6, lease_ttl_s=600
    )
    trainer = Trainer(
        TrainerSettings(**shared, trainer=section, trust=signed_trust()), event_log, S3BlobStore(settings.blobs)
    )
    worker_stop, trainer_stop = asyncio.Event(), asyncio.Event()
    rewarding = asyncio.create_task(worker.run(worker_stop))
    training = asyncio.create_task(trainer.run(trainer_stop))

    async def trained_through(version: int) -> bool:
        for task in (rewarding, training):
            if task.done() and not (task is training and version == 6):
                task.result()
                raise AssertionError(f"{task} ended early")
        metrics = [r.event async for r in replay(event_log, METRICS.name, f"rl.{run}.metrics.>")]
        return any(isinstance(m, TrainerMetrics) and m.version >= version for m in metrics)

    async def publish(first: int, last: int) -> None:
        for trajectories, _ in groups[first : last + 1]:
            for t in trajectories:
                await event_log.append(t)  # retried with the same msg id while the client reconnects

    try:
        await publish(0, 1)
        await _until(lambda: trained_through(2), "versions 1 and 2")

        await asyncio.to_thread(_kill_nats, settings)
        await asyncio.to_thread(_start_nats_again, settings)
        await publish(2, 3)
        await _until(lambda: trained_through(4), "versions 3 and 4, after the restart")

        capsys.readouterr()
        await asyncio.to_thread(_kill_nats, settings)
        down_at = time.monotonic()
        while time.monotonic() - down_at < OUTAGE_S:
            await asyncio.sleep(1.0)
            assert not rewarding.done() and not training.done(), "a worker ended during the outage"
        trajectory_feed = trainer.feeds[TRAJECTORIES.name]
        assert trajectory_feed.down_since is not None, "the feed does not know the log is away"
        assert worker.prompt_feed.down_since is not None
        await asyncio.to_thread(_start_nats_again, settings)
        await publish(4, 5)
        await asyncio.wait_for(training, HANG_GUARD_S)
    finally:
        worker_stop.set()
        trainer_stop.set()
        await asyncio.wait_for(asyncio.gather(rewarding, training, return_exceptions=True), HANG_GUARD_S)
    warnings = _outage_warnings(capsys.readouterr().err)

    # The outage was visible, repeatedly, with how long it had lasted, and the feeds resumed by themselves.
    feed_warnings = [w for w in warnings if w.get("consumer") == follower_name(run, "trainer", TRAJECTORIES)]
    assert len(feed_warnings) >= 3, warnings
    assert max(w["down_s"] for w in feed_warnings) >= OUTAGE_S / 2
    assert trainer.feeds[TRAJECTORIES.name].down_since is None and worker.prompt_feed.down_since is None
    # After the outage at least, each feed follows a consumer created again from its own position (after the
    # quick restart the file-stored consumer may have survived, and been followed on).
    assert trainer.feeds[TRAJECTORIES.name].recreated >= 1 and trainer.feeds[REWARDS.name].recreated >= 1
    assert rewarding.result() is None

    # Every group trained once, in the order it completed; one reward per trajectory; nothing dropped.
    assert trainer.published == [0, 1, 2, 3, 4, 5, 6]
    blobs = S3BlobStore(settings.blobs)
    trained: list[str] = []
    for version in range(1, 7):
        event = await fetch_version(event_log, run, version)
        lineage = json.loads(blobs.get_bytes(event.lineage_uri))
        trained += [g["group_id"] for g in lineage["groups"]]
        assert all(len(g["members"]) == GROUP_SIZE for g in lineage["groups"])
    assert sorted(trained) == [f"g{n}" for n in range(6)]
    assert await count_subjects(event_log, REWARDS.name, f"rl.{run}.reward.>") == 6 * GROUP_SIZE
    rewards = [r async for r in replay(event_log, REWARDS.name, f"rl.{run}.reward.>")]
    assert len(rewards) == 6 * GROUP_SIZE
    assert [r async for r in replay(event_log, TRAINER.name, f"rl.{run}.trainer.dropped")] == []
    assert [r async for r in replay(event_log, DEADLETTER.name, DEADLETTER.run_filter(run))] == []
    assert await count_subjects(event_log, PROMPTS.name, f"rl.{run}.prompts") == 1
    await event_log.close()


# ---------------------------------------------------------------- what stops the trainer


def _trainer_env(settings, model_dir, trainer_id: str) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")},
        "SPRAWL_RUN_ID": settings.run_id,
        **connection_env(settings, "trainer"),
        "SPRAWL_LOG_FORMAT": "json",
        "SPRAWL_TRAINER__MODEL_DIR": str(model_dir),
        "SPRAWL_TRAINER__TRAINER_ID": trainer_id,
        "SPRAWL_TRUST__SIGNING_KEY_FILE": str(signed_trust().signing_key_file),
    }


async def test_a_dead_feed_ends_the_trainer_process_non_zero_in_one_line(own_stack, model_dir):
    """Before: a feed that raised died in a task nobody watched; the trainer lived on, idle."""
    settings = own_stack
    event_log = await EventLog.connect(settings, worker="test-dead-feed")
    await apply(event_log.js, settings.streams, settings.run_id)
    process = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "trainer"],
        # A missing stream is believed after this grace (default 30 s, for a server restoring its streams).
        env=_trainer_env(settings, model_dir, "t-dead-feed") | {"SPRAWL_LOG__STREAM_MISSING_GRACE_S": "3"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        name = follower_name(settings.run_id, "trainer", TRAJECTORIES)

        async def following() -> bool:
            assert process.poll() is None, process.communicate()
            with contextlib.suppress(Exception):
                await event_log.js.consumer_info(TRAJECTORIES.name, name)
                return True
            return False

        await _until(following, "the trainer's trajectory feed")
        # The stream goes away under the feed: its consumer cannot be created again, which no wait fixes.
        await event_log.js.delete_stream(TRAJECTORIES.name)
        _, stderr = await asyncio.to_thread(process.communicate, timeout=HANG_GUARD_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        await event_log.close()
    assert process.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("sprawl: error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert "the trainer's trajectory feed failed: no stream captures subject" in errors[0]
    assert "the server says the stream is missing; the feed waits" in stderr  # the grace, said while it ran


async def test_a_lease_that_cannot_be_renewed_stops_the_trainer_before_it_expires(event_log, settings, model_dir):
    """Before: the renewal gave up after 6 attempts, its error unseen, and the lease expired while the
    trainer lived on."""
    section = TrainerSection(model_dir=model_dir, groups_per_batch=1, trainer_id="t-lease", lease_ttl_s=20)
    shared = settings.model_dump(include={"run_id", "nats", "blobs", "log", "streams"})
    trainer = Trainer(
        TrainerSettings(**shared, trainer=section, trust=signed_trust()), event_log, S3BlobStore(settings.blobs)
    )
    training = asyncio.create_task(trainer.run(asyncio.Event()))

    async def serving() -> bool:
        assert not training.done(), training
        return trainer.published == [0]

    await _until(serving, "version 0")
    with nats_stalled(settings):
        with pytest.raises(WorkerPartFailed, match="the trainer's lease failed: the lease of run") as failed:
            await asyncio.wait_for(training, HANG_GUARD_S)
        stopped_at = time.time()
    lost = failed.value.__cause__
    assert isinstance(lost, LeaseLost)
    assert lost.expires_in_s > 0  # stopped while the lease was still its own
    assert stopped_at < trainer.lease.expires_at
