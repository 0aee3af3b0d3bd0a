import asyncio

import msgspec
import pytest

from pipeline.errors import AppendConflict, StreamNotDeclared
from pipeline.eventlog import CLAIM_CHECK_HEADER
from pipeline.replay import replay
from pipeline.subjects import policy_filter, trajectories_filter
from schemas import ClaimCheck, decode_event
from tests.events import policy_version, reward, trajectory

pytestmark = pytest.mark.integration


async def test_republished_event_is_deduplicated_not_reapplied(event_log, settings):
    event = reward(settings.run_id, 1)
    first = await event_log.append(event)
    second = await event_log.append(event)
    assert not first.duplicate and second.duplicate
    assert second.seq == first.seq
    info = await event_log.js.stream_info("REWARDS", subjects_filter=f"rl.{settings.run_id}.reward.>")
    assert info.state.subjects == {f"rl.{settings.run_id}.reward.g0.traj-1": 1}


async def test_recreated_event_with_same_business_key_is_deduplicated(event_log, settings):
    # A producer that crashed and rebuilt the event gets a new event_id but the same business key.
    a, b = reward(settings.run_id, 7), reward(settings.run_id, 7)
    assert a.event_id != b.event_id
    assert not (await event_log.append(a)).duplicate
    assert (await event_log.append(b)).duplicate


async def test_second_create_only_publish_of_a_version_is_refused(event_log, settings):
    v0 = policy_version(settings.run_id, 0)
    await event_log.append(v0, expected_last_subject_seq=0)
    # A different event (another trainer) for the same version subject: different msg id, so no dedup.
    rival = policy_version(settings.run_id, 0)
    with pytest.raises(AppendConflict, match="second trainer"):
        await event_log.append(rival, expected_last_subject_seq=0, subject=f"rl.{settings.run_id}.policy.v0")


async def test_version_chain_is_fenced_on_the_previous_version(event_log, settings):
    fence = policy_filter(settings.run_id)
    v0 = await event_log.append(policy_version(settings.run_id, 0), expected_last_subject_seq=0, fence_subject=fence)
    v1_event = policy_version(settings.run_id, 1)
    v1 = await event_log.append(v1_event, expected_last_subject_seq=v0.seq, fence_subject=fence)
    # A second trainer that still believes v0 is the head cannot append its own v1 or a v2.
    with pytest.raises(AppendConflict):
        await event_log.append(
            policy_version(settings.run_id, 1), expected_last_subject_seq=v0.seq, fence_subject=fence
        )
    with pytest.raises(AppendConflict):
        await event_log.append(
            policy_version(settings.run_id, 2), expected_last_subject_seq=v0.seq, fence_subject=fence
        )
    # The legitimate writer retrying its own v1 is a duplicate, not a conflict.
    again = await event_log.append(v1_event, expected_last_subject_seq=v0.seq, fence_subject=fence)
    assert again.duplicate and again.seq == v1.seq


async def test_policy_stream_refuses_delete_and_purge(event_log, settings):
    result = await event_log.append(policy_version(settings.run_id, 0), expected_last_subject_seq=0)
    with pytest.raises(Exception, match=r"(?i)delete|purge|not permitted|denied"):
        await event_log.js.delete_msg("POLICY", result.seq)
    with pytest.raises(Exception, match=r"(?i)purge|not permitted|denied"):
        await event_log.js.purge_stream("POLICY")


async def test_large_event_is_claim_checked_and_resolved_transparently(event_log, settings):
    big = trajectory(settings.run_id, "big-1", output_tokens=20_000)
    result = await event_log.append(big)
    assert result.claim_checked
    msg = await event_log.js.get_msg("TRAJECTORIES", result.seq)
    assert len(msg.data) < 2048
    assert msg.headers[CLAIM_CHECK_HEADER] == "1"
    claim = decode_event(msg.data)
    assert isinstance(claim, ClaimCheck) and claim.bytes > 256 * 1024
    assert await event_log.resolve(msg.data) == msgspec.structs.replace(big, producer=event_log.producer)


async def test_append_to_an_undeclared_subject_says_to_run_infra_apply(event_log):
    with pytest.raises(StreamNotDeclared, match="sprawl infra apply"):
        await event_log.append(reward("r-undeclared", 1), subject="nowhere.at.all")


async def test_replay_from_a_sequence_and_from_a_time(event_log, settings):
    results = []
    for n in range(5):
        results.append(await event_log.append(trajectory(settings.run_id, f"replay-{n}", 4)))
        if n == 2:
            await asyncio.sleep(0.05)
    everything = [r async for r in replay(event_log, "TRAJECTORIES", trajectories_filter(settings.run_id))]
    assert [r.event.trajectory_id for r in everything] == [f"replay-{n}" for n in range(5)]
    tail = [
        r
        async for r in replay(event_log, "TRAJECTORIES", trajectories_filter(settings.run_id), start_seq=results[3].seq)
    ]
    assert [r.stream_seq for r in tail] == [results[3].seq, results[4].seq]
    at = everything[3].event.produced_at
    since = [r async for r in replay(event_log, "TRAJECTORIES", trajectories_filter(settings.run_id), start_time=at)]
    assert [r.event.trajectory_id for r in since][-2:] == ["replay-3", "replay-4"]
    nothing = [r async for r in replay(event_log, "TRAJECTORIES", f"rl.{settings.run_id}.traj.nobody")]
    assert nothing == []
