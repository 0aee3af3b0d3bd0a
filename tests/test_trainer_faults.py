"""The trainer when the log misbehaves: incomplete groups are dropped and counted, and a stalled log
is never read as "no checkpoint"."""

import asyncio
import time

import pytest

from pipeline.blobstore import S3BlobStore
from pipeline.replay import replay
from pipeline.topology import METRICS, TRAINER
from schemas import GroupDropped, TrainerMetrics
from tests.chain_helpers import signed_trust
from tests.test_stalled_log import nats_stalled
from tests.trainer_data import make_groups, publish_groups, write_initial_model
from workers.trainer.checkpoint import latest_checkpoint
from workers.trainer.loop import Trainer
from workers.trainer.settings import TrainerSection, TrainerSettings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_model(tmp_path_factory.mktemp("initial"))


async def test_dropped_groups_are_announced_and_counted_in_the_metrics(event_log, settings, model_dir):
    """Before: `groups_dropped_total` was always 0, whatever the trainer dropped."""
    groups = make_groups(model_dir, settings.run_id, 3)
    incomplete = (groups[0][0], groups[0][1][:-1])  # one reward never comes: the group can't complete
    await publish_groups(event_log, [incomplete])
    section = TrainerSection(model_dir=model_dir, groups_per_batch=1, trainer_id="t-drop", max_group_wait_s=0.5)
    trainer_settings = TrainerSettings(
        **settings.model_dump(include={"run_id", "nats", "blobs", "log", "streams"}),
        trust=signed_trust(),
        trainer=section.model_copy(update={"max_versions": 2}),
    )
    trainer = Trainer(trainer_settings, event_log, S3BlobStore(settings.blobs))
    run = asyncio.create_task(trainer.run(asyncio.Event()))
    dropped_filter = f"rl.{settings.run_id}.trainer.dropped"
    while not [r async for r in replay(event_log, TRAINER.name, dropped_filter)]:
        assert not run.done(), run
        await asyncio.sleep(0.1)
    await publish_groups(event_log, groups[1:])
    await run
    dropped = [r.event async for r in replay(event_log, TRAINER.name, dropped_filter)]
    assert [d.group_id for d in dropped if isinstance(d, GroupDropped)] == ["g0"]
    assert "the log holds 4 trajectories and 3 rewards of it" in dropped[0].reason
    metrics = [r.event async for r in replay(event_log, METRICS.name, f"rl.{settings.run_id}.metrics.>")]
    totals = [m.metrics["groups_dropped_total"] for m in metrics if isinstance(m, TrainerMetrics)]
    assert totals == [1.0, 1.0]


async def test_a_stalled_log_is_an_error_not_a_missing_checkpoint(event_log, settings):
    """Before: any failure to read the checkpoint subject meant "start from scratch"."""
    assert await latest_checkpoint(event_log, settings.run_id) is None
    with nats_stalled(settings), pytest.raises(Exception) as failure:
        await latest_checkpoint(event_log, settings.run_id)
    assert not isinstance(failure.value, AssertionError)


async def test_a_group_the_log_holds_more_of_than_the_feeds_delivered_is_not_dropped(event_log, settings, model_dir):
    """Before: "incomplete after 300s: 9/16" while the log held 16/16, and a later trainer trained it.
    Now an overdue group is given another wait while the feeds are behind the log, and dropped only
    after a wait in which they delivered nothing more of it, with the log's counts in the reason."""
    ((trajectories, rewards),) = make_groups(model_dir, settings.run_id, 1)
    await publish_groups(event_log, [(trajectories, rewards)])  # the log holds the whole group
    section = TrainerSection(model_dir=model_dir, groups_per_batch=1, trainer_id="t-behind", max_group_wait_s=10)
    trainer_settings = TrainerSettings(
        **settings.model_dump(include={"run_id", "nats", "blobs", "log", "streams"}),
        trust=signed_trust(),
        trainer=section,
    )
    trainer = Trainer(trainer_settings, event_log, S3BlobStore(settings.blobs))
    long_ago = time.monotonic() - 60  # as if the feeds had stalled on the rest of it since then
    for seq, t in enumerate(trajectories[:2], start=1):
        trainer.assembler.add_trajectory(t, seq, long_ago)
    trainer.assembler.add_reward(rewards[0], 1, long_ago)

    await trainer._drop_expired()
    assert "g0" in trainer.assembler.pending and trainer.groups_dropped == 0  # the feeds are behind: wait

    trainer.assembler.add_trajectory(trajectories[2], 3, long_ago)  # the feed delivered more meanwhile
    trainer.assembler.pending["g0"].first_seen = long_ago
    await trainer._drop_expired()
    assert "g0" in trainer.assembler.pending and trainer.groups_dropped == 0

    trainer.assembler.pending["g0"].first_seen = long_ago  # a whole wait, and nothing more came
    await trainer._drop_expired()
    assert "g0" not in trainer.assembler.pending and trainer.groups_dropped == 1
    dropped = [r.event async for r in replay(event_log, TRAINER.name, f"rl.{settings.run_id}.trainer.dropped")]
    assert len(dropped) == 1 and isinstance(dropped[0], GroupDropped)
    assert "3/4 trajectories, 1/4 rewards" in dropped[0].reason
    assert "the log holds 4 trajectories and 4 rewards of it" in dropped[0].reason
