"""Joining trajectories and rewards into groups: order, completeness, drops, use-once."""

import pytest

from pipeline.batching import BatchAssembler
from schemas import IslandIdentity, Reward, Trajectory, VersionSpan

ISLAND = IslandIdentity(island_id="i", accelerator="cpu", view="bf16", engine="torch")


def _traj(group: str, i: int, n: int = 2) -> Trajectory:
    return Trajectory(
        run_id="r",
        trajectory_id=f"{group}-{i}",
        group_id=group,
        sample_index=i,
        task="t",
        prompt_token_ids=[1],
        output_token_ids=[2],
        logprobs=[-1.0],
        finish_reason="stop",
        version_spans=[VersionSpan(version=0, start=0, end=1)],
        island=ISLAND,
        group_size=n,
    )


def _reward(group: str, i: int) -> Reward:
    return Reward(
        run_id="r",
        trajectory_id=f"{group}-{i}",
        group_id=group,
        value=1.0,
        verifier="v",
        verifier_version="1",
        duration_s=0.0,
    )


def _feed(order: list[tuple[str, str, int, int]]) -> list[str]:
    a = BatchAssembler(groups_per_batch=2, default_group_size=2, max_wait_s=60)
    for kind, group, i, seq in order:
        if kind == "t":
            a.add_trajectory(_traj(group, i), seq, 0.0)
        else:
            a.add_reward(_reward(group, i), seq, 0.0)
    batch = a.take_batch()
    assert batch is not None and a.take_batch() is None
    assert all([t.sample_index for t in item.trajectories] == [0, 1] for item in batch)
    return [item.group_id for item in batch]


def test_batches_depend_on_log_sequences_not_on_arrival_order():
    # On the log: trajectories a0 a1 b0 b1 c0 c1 (seq 1-6), rewards c0 c1 b0 b1 a0 (seq 1-5): c and b complete.
    log = [
        ("t", "a", 0, 1),
        ("t", "a", 1, 2),
        ("t", "b", 0, 3),
        ("t", "b", 1, 4),
        ("t", "c", 0, 5),
        ("t", "c", 1, 6),
        ("r", "c", 0, 1),
        ("r", "c", 1, 2),
        ("r", "b", 0, 3),
        ("r", "b", 1, 4),
        ("r", "a", 0, 5),
    ]
    first = _feed(log)
    assert first == ["b", "c"]  # completed at max(traj, reward) seq 4 and 6
    assert _feed(list(reversed(log))) == first
    assert _feed(log[6:] + log[:6]) == first


def test_used_trajectories_are_ignored_when_seen_again():
    a = BatchAssembler(groups_per_batch=1, default_group_size=2, max_wait_s=60)
    for i in range(2):
        a.add_trajectory(_traj("a", i), i + 1, 0.0)
        a.add_reward(_reward("a", i), i + 1, 0.0)
    assert a.take_batch() is not None
    for i in range(2):  # a redelivery, or a replay after a restart
        a.add_trajectory(_traj("a", i), i + 1, 1.0)
        a.add_reward(_reward("a", i), i + 1, 1.0)
    assert a.pending == {} and a.take_batch() is None


def test_incomplete_groups_are_dropped_with_a_reason_after_the_wait():
    a = BatchAssembler(groups_per_batch=1, default_group_size=3, max_wait_s=10)
    a.add_trajectory(_traj("slow", 0, n=3), 7, 0.0)
    a.add_reward(_reward("slow", 0), 9, 0.0)
    assert a.expire(5.0) == []
    assert a.positions(20, 30) == (7, 9)  # a restart must re-read from what is still pending
    ((group, reason),) = a.expire(11.0)
    assert group.group_id == "slow" and "1/3 trajectories, 1/3 rewards" in reason
    assert a.positions(20, 30) == (20, 30)
    a.add_trajectory(_traj("slow", 1, n=3), 12, 12.0)  # a straggler of a dropped group starts a new one
    assert "slow-0" in a.used


def test_an_assembler_that_could_only_make_empty_batches_is_refused():
    for bad in (
        {"groups_per_batch": 0, "default_group_size": 2, "max_wait_s": 1.0},
        {"groups_per_batch": 1, "default_group_size": 0, "max_wait_s": 1.0},
        {"groups_per_batch": 1, "default_group_size": 2, "max_wait_s": 0.0},
    ):
        with pytest.raises(ValueError):
            BatchAssembler(**bad)
