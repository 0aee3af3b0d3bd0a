"""What the log server itself guarantees: one message per logical-id subject (a policy version, a
trajectory, a reward, a dead letter), at any time and whoever publishes; our own retried append told
apart from a rival's; an old stream upgraded without losing history; counts on the server's word."""

import asyncio

import msgspec
import nats.js.errors
import pytest
from nats.js import api

from infra import stack
from infra.stack import StackSection
from infra.streams import apply, stream_config
from pipeline.config import LogSettings, NatsSettings, StreamSettings
from pipeline.errors import StreamUpgradeRefused, SubjectTaken
from pipeline.eventlog import EventLog, connect_nats
from pipeline.log_lookup import count_subjects
from pipeline.subjects import (
    dead_letter_subject,
    group_trajectories_filter,
    policy_subject,
    reward_subject,
    subject_for,
    trajectory_subject,
)
from pipeline.topology import DEADLETTER, POLICY, REWARDS, STREAMS, TRAJECTORIES, follower_name
from schemas import DeadLetter, encode_event
from tests.events import policy_version, reward, trajectory
from tests.servers import HANG_GUARD_S, START_TIMEOUT_S, admin_nats, new_run_id

pytestmark = pytest.mark.integration

SUBJECT_FULL = 10077
"""JetStream's 'maximum messages per subject exceeded'."""


class RekeyedLog(EventLog):
    """A producer that keys its events differently (another client, or a re-created event under a new
    key): the same logical id under a message id the dedup window has never seen."""

    def msg_id(self, event) -> str:
        return f"rekeyed:{event.event_id}"


async def messages_on(event_log: EventLog, stream: str, subject: str) -> int:
    info = await event_log.js.stream_info(stream, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


def dead_letter(run_id: str, seq: int, consumer: str) -> DeadLetter:
    return DeadLetter(
        run_id=run_id,
        reason="undecodable",
        error_class="malformed",
        stream="prompts",
        consumer=consumer,
        original_subject=f"rl.{run_id}.prompts",
        original_seq=seq,
        num_delivered=1,
        payload=b"\x00garbage",
    )


# ---------------------------------------------------------------- names


def test_a_followers_name_carries_the_run_the_reader_and_the_stream():
    assert follower_name("Run-1", "trainer", TRAJECTORIES) == "run-1-trainer-trajectories"
    assert follower_name("run-1", "rewards", REWARDS) == "run-1-rewards-rewards"
    with pytest.raises(ValueError, match="reader"):
        follower_name("run-1", "a.b", TRAJECTORIES)


def test_logical_ids_have_a_subject_each():
    traj = trajectory("r1", "g7-3", output_tokens=2, group="g7")
    assert subject_for(traj) == trajectory_subject("r1", "g7", "g7-3") == "rl.r1.traj.g7.g7-3"
    assert subject_for(reward("r1", 3, group="g7")) == reward_subject("r1", "g7", "traj-3") == "rl.r1.reward.g7.traj-3"
    assert subject_for(dead_letter("r1", 42, "x")) == dead_letter_subject("r1", "prompts", 42)
    assert dead_letter_subject("r1", "prompts", 42) == "rl.r1.deadletter.prompts.42"
    assert group_trajectories_filter("r1", "g7") == "rl.r1.traj.g7.*"


def test_the_streams_of_logical_ids_keep_one_message_per_subject_and_refuse_the_next():
    limited = {s.name for s in STREAMS if s.one_message_per_subject}
    assert limited == {POLICY.name, TRAJECTORIES.name, REWARDS.name, DEADLETTER.name}
    for stream in STREAMS:
        config = stream_config(stream, StreamSettings())
        if stream.name in limited:
            assert (config.max_msgs_per_subject, config.discard, config.discard_new_per_subject) == (
                1,
                api.DiscardPolicy.NEW,
                True,
            )
        else:  # heartbeats, metrics, checkpoints: a history per subject
            assert (config.max_msgs_per_subject, config.discard) == (-1, api.DiscardPolicy.OLD)


# ---------------------------------------------------------------- the session server


async def test_a_rival_unfenced_version_is_refused_by_the_server(event_log, settings):
    run = settings.run_id
    ours = await event_log.append(policy_version(run, 1))
    rival = policy_version(run, 1)  # another trainer's v1: another event id, so another message id
    with pytest.raises(SubjectTaken, match="already holds a policy version for version 1") as refused:
        await event_log.append(rival)
    assert refused.value.holder_msg_id == ours.msg_id
    assert refused.value.subject == policy_subject(run, 1)
    assert await messages_on(event_log, POLICY.name, policy_subject(run, 1)) == 1
    head = await event_log.js.get_last_msg(POLICY.name, policy_subject(run, 1))
    assert head.seq == ours.seq


async def test_a_trajectory_id_republished_under_a_new_message_id_is_stored_once(event_log, settings):
    run = settings.run_id
    traj = trajectory(run, "g1-0", output_tokens=4, group="g1")
    first = await event_log.append(traj)
    subject = trajectory_subject(run, "g1", "g1-0")
    # A client of its own, publishing the same trajectory under a message id nobody used.
    with pytest.raises(nats.js.errors.APIError) as refused:
        await event_log.js.publish(subject, encode_event(traj), headers={"Nats-Msg-Id": "a-fresh-id"})
    assert refused.value.err_code == SUBJECT_FULL
    # Through our own client, re-keyed: the refusal names what the log already holds.
    rekeyed = RekeyedLog(event_log.nc, None, event_log.settings, "rekeyed")
    with pytest.raises(SubjectTaken, match="already holds a trajectory for trajectory g1-0") as taken:
        await rekeyed.append(traj)
    assert taken.value.holder_msg_id == first.msg_id
    assert await messages_on(event_log, TRAJECTORIES.name, subject) == 1


async def test_a_trajectory_gets_one_reward_whoever_scores_it(event_log, settings):
    run = settings.run_id
    first = await event_log.append(reward(run, 5, group="g2"))
    # Another worker scoring the same trajectory: same business key, so the window calls it ours.
    again = await event_log.append(reward(run, 5, group="g2"))
    assert again.duplicate and again.seq == first.seq
    # A reward for it under another message id: refused by the server, not stored beside the first.
    different = msgspec.structs.replace(reward(run, 5, group="g2"), value=-1.0)
    rekeyed = RekeyedLog(event_log.nc, None, event_log.settings, "rekeyed")
    with pytest.raises(SubjectTaken, match="reward for trajectory traj-5"):
        await rekeyed.append(different)
    stored = await event_log.js.get_last_msg(REWARDS.name, reward_subject(run, "g2", "traj-5"))
    assert stored.seq == first.seq
    assert (await event_log.resolve(stored.data)).value == 5.0


async def test_a_message_refused_by_two_consumers_has_one_dead_letter(event_log, settings):
    run = settings.run_id
    by_sampler = await event_log.append(dead_letter(run, 42, "samplers"))
    by_archiver = await event_log.append(dead_letter(run, 42, "archiver-prompts"))
    assert not by_sampler.duplicate
    assert by_archiver.duplicate and by_archiver.seq == by_sampler.seq
    other_seq = await event_log.append(dead_letter(run, 43, "archiver-prompts"))
    assert not other_seq.duplicate
    rekeyed = RekeyedLog(event_log.nc, None, event_log.settings, "rekeyed")
    with pytest.raises(SubjectTaken, match="message 42 of prompts"):
        await rekeyed.append(dead_letter(run, 42, "someone-else"))
    assert await count_subjects(event_log, DEADLETTER.name, f"rl.{run}.deadletter.prompts.*") == 2
    assert await messages_on(event_log, DEADLETTER.name, dead_letter_subject(run, "prompts", 42)) == 1


async def test_count_subjects_counts_what_the_server_holds(event_log, settings):
    run = settings.run_id
    for n in range(3):
        await event_log.append(trajectory(run, f"ga-{n}", output_tokens=4, group="ga"))
    await event_log.append(trajectory(run, "ga-0", output_tokens=4, group="ga"))  # a retry: still three
    await event_log.append(trajectory(run, "gb-0", output_tokens=4, group="gb"))
    assert await count_subjects(event_log, TRAJECTORIES.name, group_trajectories_filter(run, "ga")) == 3
    assert await count_subjects(event_log, TRAJECTORIES.name, group_trajectories_filter(run, "gb")) == 1
    assert await count_subjects(event_log, TRAJECTORIES.name, group_trajectories_filter(run, "nobody")) == 0


# ---------------------------------------------------------------- a server of our own


@pytest.fixture
def private_nats(tmp_path):
    """A nats-server of our own: its streams can have a tiny dedup window or an old config without
    touching the session's. Stopped by pid at the end."""
    record = stack.start_nats(tmp_path, StackSection(nats_port=0, nats_monitor_port=0, start_timeout_s=START_TIMEOUT_S))
    try:
        yield admin_nats(tmp_path, record.endpoint)
    finally:
        stack.stop_servers([record])


@pytest.fixture
async def private_log(private_nats):
    nc = await connect_nats(private_nats, name="test-log-guarantees")
    log = EventLog(nc, None, LogSettings(publish_attempts=4, publish_backoff_s=0.1), "test-log-guarantees")
    try:
        yield log
    finally:
        await log.close()


TINY_WINDOW_S = 0.5
BRIEF_PRODUCERS = {  # producers that give up at once, so the dedup floor stays below the tiny window
    "log": LogSettings(publish_timeout_s=0.1, publish_attempts=1, publish_backoff_s=0.0),
    "nats": NatsSettings(connect_timeout_s=0.1, reconnect_wait_s=0.0),
}


async def wait_until_forgotten(event_log: EventLog, subject: str, data: bytes, msg_id: str) -> None:
    """Re-publish `msg_id` until the server no longer calls it a duplicate: then the dedup window has
    forgotten it, and only the one-message-per-subject limit stands between it and a second copy."""
    async with asyncio.timeout(HANG_GUARD_S):
        while True:
            try:
                ack = await event_log.js.publish(subject, data, headers={"Nats-Msg-Id": msg_id})
            except nats.js.errors.APIError as exc:
                assert exc.err_code == SUBJECT_FULL
                return
            assert ack.duplicate, "a forgotten id on a full subject must be refused, never stored"
            await asyncio.sleep(TINY_WINDOW_S / 2)


async def test_beyond_the_dedup_window_our_retry_is_a_duplicate_and_a_rivals_is_refused(private_log):
    run = new_run_id()
    report = await apply(private_log.js, StreamSettings(duplicate_window_s=TINY_WINDOW_S), run, **BRIEF_PRODUCERS)
    assert f"stream {TRAJECTORIES.name}" in report.created
    assert (await private_log.js.stream_info(TRAJECTORIES.name)).config.duplicate_window == TINY_WINDOW_S

    traj = trajectory(run, "g3-0", output_tokens=4, group="g3")
    first = await private_log.append(traj)
    subject = trajectory_subject(run, "g3", "g3-0")
    await wait_until_forgotten(private_log, subject, encode_event(traj), first.msg_id)

    # Our own append, retried long after it landed (its ack was lost, or the producer restarted).
    again = await private_log.append(traj)
    assert again.duplicate and again.seq == first.seq
    # The same trajectory id under a new message id, after the window: still refused.
    with pytest.raises(SubjectTaken, match="trajectory g3-0"):
        await RekeyedLog(private_log.nc, None, private_log.settings, "rekeyed").append(traj)
    # A second reward for one trajectory, after the window, from a client with its own message ids.
    scored = await private_log.append(reward(run, 9, group="g3"))
    await wait_until_forgotten(
        private_log, reward_subject(run, "g3", "traj-9"), encode_event(reward(run, 9, group="g3")), scored.msg_id
    )
    with pytest.raises(SubjectTaken, match="reward for trajectory traj-9"):
        await RekeyedLog(private_log.nc, None, private_log.settings, "rekeyed").append(reward(run, 9, group="g3"))
    assert await messages_on(private_log, TRAJECTORIES.name, subject) == 1
    assert await messages_on(private_log, REWARDS.name, reward_subject(run, "g3", "traj-9")) == 1


def old_config(stream, settings: StreamSettings) -> api.StreamConfig:
    """A stream as applied before one message per subject: history kept, nothing refused."""
    config = stream_config(stream, settings)
    config.max_msgs_per_subject, config.discard, config.discard_new_per_subject = -1, api.DiscardPolicy.OLD, False
    return config


async def test_apply_gives_an_old_stream_one_message_per_subject_keeping_its_history(private_log):
    run, settings = new_run_id(), StreamSettings()
    for stream in STREAMS:
        await private_log.js.add_stream(old_config(stream, settings))
    versions = [await private_log.append(policy_version(run, v)) for v in range(3)]

    report = await apply(private_log.js, settings, run)
    assert {f"stream {s.name}" for s in STREAMS if s.one_message_per_subject} <= set(report.updated)
    policy = await private_log.js.stream_info(POLICY.name)
    assert (policy.config.max_msgs_per_subject, policy.config.discard, policy.config.discard_new_per_subject) == (
        1,
        api.DiscardPolicy.NEW,
        True,
    )
    assert policy.state.messages == 3  # nothing deleted
    assert (await private_log.js.get_last_msg(POLICY.name, policy_subject(run, 2))).seq == versions[2].seq
    with pytest.raises(SubjectTaken):
        await private_log.append(policy_version(run, 2))

    again = await apply(private_log.js, settings, run)
    assert not again.updated and not again.created
    assert {f"stream {s.name}" for s in STREAMS} <= set(again.unchanged)


async def test_apply_refuses_to_limit_a_stream_whose_subjects_hold_history(private_log):
    run, settings = new_run_id(), StreamSettings()
    await private_log.js.add_stream(old_config(TRAJECTORIES, settings))
    old_layout = f"rl.{run}.traj.g0"  # one subject per group, as trajectories were stored before
    for n in range(2):
        traj = trajectory(run, f"g0-{n}", output_tokens=2)
        await private_log.js.publish(old_layout, encode_event(traj), headers={"Nats-Msg-Id": f"old-{n}"})

    with pytest.raises(StreamUpgradeRefused, match=rf"TRAJECTORIES .*{old_layout} \(2\)"):
        await apply(private_log.js, settings, run)
    kept = await private_log.js.stream_info(TRAJECTORIES.name)
    assert kept.state.messages == 2
    assert kept.config.max_msgs_per_subject == -1
