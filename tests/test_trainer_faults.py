"""The trainer when the log misbehaves: incomplete groups are dropped and counted, and a stalled log
is never read as "no checkpoint"."""

import asyncio

import pytest

from pipeline.blobstore import S3BlobStore
from pipeline.replay import replay
from pipeline.topology import METRICS, TRAINER
from schemas import GroupDropped, TrainerMetrics
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
    metrics = [r.event async for r in replay(event_log, METRICS.name, f"rl.{settings.run_id}.metrics.>")]
    totals = [m.metrics["groups_dropped_total"] for m in metrics if isinstance(m, TrainerMetrics)]
    assert totals == [1.0, 1.0]


async def test_a_stalled_log_is_an_error_not_a_missing_checkpoint(event_log, settings):
    """Before: any failure to read the checkpoint subject meant "start from scratch"."""
    assert await latest_checkpoint(event_log, settings.run_id) is None
    with nats_stalled(settings), pytest.raises(Exception) as failure:
        await latest_checkpoint(event_log, settings.run_id)
    assert not isinstance(failure.value, AssertionError)
