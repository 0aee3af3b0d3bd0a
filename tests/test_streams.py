import pytest
from nats.js import api

from infra.streams import STREAMS, apply, consumers_for_run
from pipeline.config import StreamSettings

pytestmark = pytest.mark.integration


async def test_apply_is_idempotent(event_log, settings):
    # The fixture applied once already; a second and third apply change nothing.
    second = await apply(event_log.js, settings.streams, settings.run_id)
    third = await apply(event_log.js, settings.streams, settings.run_id)
    for report in (second, third):
        assert report.created == [] and report.updated == []
        assert len(report.unchanged) == len(STREAMS) + len(consumers_for_run(settings.run_id))


async def test_declared_streams_keep_history(event_log):
    for spec in STREAMS:
        config = (await event_log.js.stream_info(spec.name)).config
        assert config.retention == api.RetentionPolicy.LIMITS, spec.name
        assert config.duplicate_window and config.duplicate_window > 0
    policy = (await event_log.js.stream_info("POLICY")).config
    assert policy.deny_delete and policy.deny_purge


async def test_declared_consumers_bound_redelivery(event_log, settings):
    for spec in consumers_for_run(settings.run_id):
        config = (await event_log.js.consumer_info(spec.stream, spec.name)).config
        assert config.ack_policy == api.AckPolicy.EXPLICIT
        assert config.max_deliver == settings.streams.max_deliver
        assert config.backoff and config.max_ack_pending == (spec.max_ack_pending or settings.streams.max_ack_pending)


async def test_changed_settings_update_consumers_in_place(event_log, settings):
    changed = settings.streams.model_copy(update={"max_ack_pending": 7})
    report = await apply(event_log.js, changed, settings.run_id)
    assert len(report.updated) == sum(1 for c in consumers_for_run(settings.run_id) if c.max_ack_pending is None)
    info = await event_log.js.consumer_info("TRAJECTORIES", f"{settings.run_id}-rewards")
    assert info.config.max_ack_pending == 7
    await apply(event_log.js, settings.streams, settings.run_id)


def test_replicas_are_configurable():
    from infra.streams import consumer_config, stream_config

    cluster = StreamSettings(replicas=3)
    assert stream_config(STREAMS[0], cluster).num_replicas == 3
    assert consumer_config(consumers_for_run("r")[0], cluster).num_replicas == 3
