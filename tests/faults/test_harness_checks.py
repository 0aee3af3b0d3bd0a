"""The harness's own checks, on readings made up to break each invariant: every check can fail."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec

from pipeline.topology import subject_matches
from schemas.lineage import Lineage, LineageGroup, LineageMember
from tests.events import policy_version, reward, trajectory
from workers.bench.faults.invariants import judge_log_and_archive, loop_recovery_seconds, recovery_seconds
from workers.bench.faults.ledger import ArchivedRow, LoggedMessage

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _msg(stream: str, seq: int, event, at: datetime = T0) -> LoggedMessage:
    return LoggedMessage(stream, seq, "rl.r.x", at, type(event).type_tag(), event, b"", {})


def _reward(trajectory_id: str):
    return msgspec.structs.replace(reward("r", 0), trajectory_id=trajectory_id)


def _clean():
    t1, t2 = trajectory("r", "t1", 3), trajectory("r", "t2", 3)
    scan = {
        "trajectories": [_msg("trajectories", 1, t1), _msg("trajectories", 2, t2)],
        "rewards": [_msg("rewards", 1, _reward(t1.trajectory_id)), _msg("rewards", 2, _reward(t2.trajectory_id))],
        "policy": [_msg("policy", 1, policy_version("r", 1), T0 + timedelta(seconds=5))],
    }
    archive = [ArchivedRow(m.event_type, m.stream, m.seq) for ms in scan.values() for m in ms]
    lineage = {
        1: Lineage(
            1, [LineageGroup("g", [LineageMember(t1.trajectory_id, 1, 1), LineageMember(t2.trajectory_id, 2, 2)])]
        )
    }
    return scan, archive, lineage


def _judge(scan, archive, lineages, seen_before=frozenset(), acked=frozenset()):
    return judge_log_and_archive(
        seen_before=set(seen_before),
        acked=set(acked),
        scan=scan,
        archive=archive,
        lineages=lineages,
        lineage_unreadable={},
    )


def test_a_clean_run_has_nothing_lost_or_duplicated():
    scan, archive, lineages = _clean()
    findings = _judge(scan, archive, lineages, seen_before={("trajectories", 1)}, acked={("rewards", 2)})
    assert (findings.lost, findings.duplicated, findings.details) == (0, 0, {})


def test_an_acked_event_gone_from_the_log_is_lost():
    scan, archive, lineages = _clean()
    findings = _judge(
        scan, archive, lineages, seen_before={("trajectories", 1), ("prompts", 7)}, acked={("prompts", 8)}
    )
    assert findings.lost == 2 and findings.details["acked_missing_from_log"]["count"] == 2


def test_a_log_event_missing_from_the_archive_is_lost_and_a_row_twice_is_duplicated():
    scan, archive, lineages = _clean()
    findings = _judge(scan, [*archive[1:], archive[-1]], lineages)
    assert findings.lost == 1 and findings.duplicated == 1
    assert findings.details["archive_count_differs_by_type"]["trajectory.v1"] == {"log": 2, "archive": 1}


def test_a_trajectory_trained_twice_and_rewarded_twice_is_duplicated():
    scan, archive, lineages = _clean()
    first = lineages[1].groups[0].members[0]
    lineages[2] = Lineage(2, [LineageGroup("g", [first])])
    scan["rewards"].append(_msg("rewards", 3, _reward(first.trajectory_id)))
    archive.append(ArchivedRow("reward.v1", "rewards", 3))
    findings = _judge(scan, archive, lineages)
    assert findings.duplicated == 2 and set(findings.details) == {"trajectories_trained_twice", "rewards_counted_twice"}


def test_a_lineage_entry_the_log_does_not_hold_is_lost():
    scan, archive, lineages = _clean()
    lineages[2] = Lineage(2, [LineageGroup("g", [LineageMember("nowhere", 99, 1)])])
    assert _judge(scan, archive, lineages).details["lineage_entries_not_in_log"]["count"] == 1


def test_recovery_is_the_first_version_stored_after_the_fault():
    scan, _, _ = _clean()
    assert recovery_seconds(scan, T0) == 5.0
    assert recovery_seconds(scan, T0 + timedelta(seconds=6)) is None


def test_subject_matching_follows_nats_wildcards():
    assert subject_matches("rl.r.traj.>", "rl.r.traj.g.t")
    assert not subject_matches("rl.r.traj.>", "rl.r.traj")
    assert subject_matches("rl.*.prompts", "rl.r.prompts")
    assert not subject_matches("rl.r.prompts", "rl.r.prompts.x")


def test_loop_recovery_needs_a_version_trained_on_a_trajectory_sampled_after_the_fault():
    scan, _, lineages = _clean()  # v1 (stored at +5 s) trained on trajectories at seqs 1 and 2
    assert loop_recovery_seconds(scan, lineages, T0, trajectory_mark=1) == 5.0
    assert loop_recovery_seconds(scan, lineages, T0, trajectory_mark=2) is None
