"""Joining trajectories with their rewards into complete prompt groups, and groups into updates.

Deterministic on purpose: complete groups are taken in the order of the stream sequence at which
they completed (the later of their trajectory and reward sequences), so the same log gives the same
batches, whatever order a restarted trainer re-reads it in. Each trajectory is used at most once:
ids already used (recorded in lineage and checkpoints) are ignored when they show up again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import Reward, Trajectory


@dataclass
class Member:
    trajectory: Trajectory | None = None
    trajectory_seq: int = 0
    reward: Reward | None = None
    reward_seq: int = 0


@dataclass
class PendingGroup:
    group_id: str
    first_seen: float
    members: dict[str, Member] = field(default_factory=dict)
    size: int = 0
    deferred_at: tuple[int, int] | None = None
    """`counts()` when a drop was last deferred because the log held more than the feeds had delivered."""

    def complete(self) -> bool:
        done = [m for m in self.members.values() if m.trajectory is not None and m.reward is not None]
        return self.size > 0 and len(done) >= self.size

    def completed_at_seq(self) -> int:
        return max(max(m.trajectory_seq, m.reward_seq) for m in self.members.values())

    def counts(self) -> tuple[int, int]:
        """(trajectories, rewards) of this group the feeds have delivered."""
        trajectories = sum(1 for m in self.members.values() if m.trajectory is not None)
        return trajectories, sum(1 for m in self.members.values() if m.reward is not None)

    def min_seq(self, kind: str) -> int | None:
        seqs = [getattr(m, f"{kind}_seq") for m in self.members.values() if getattr(m, f"{kind}_seq")]
        return min(seqs) if seqs else None


@dataclass(frozen=True)
class GroupBatchItem:
    group_id: str
    trajectories: list[Trajectory]
    rewards: list[Reward]
    trajectory_seqs: list[int]
    reward_seqs: list[int]


class BatchAssembler:
    """Complete groups in, batches of `groups_per_batch` out. The trainer passes its settings'
    `groups_per_batch`, `group_size` and `max_group_wait_s` (validated there); other callers get the
    same bounds checked here, since an empty batch would be an update on nothing."""

    def __init__(self, *, groups_per_batch: int, default_group_size: int, max_wait_s: float):
        if groups_per_batch < 1 or default_group_size < 1:
            raise ValueError(
                f"groups_per_batch ({groups_per_batch}) and default_group_size ({default_group_size}) must be >= 1"
            )
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s}")
        self.groups_per_batch = groups_per_batch
        self.default_group_size = default_group_size
        self.max_wait_s = max_wait_s
        self.pending: dict[str, PendingGroup] = {}
        self.used: set[str] = set()

    def _group(self, group_id: str, now: float) -> PendingGroup:
        if group_id not in self.pending:
            self.pending[group_id] = PendingGroup(group_id, now, size=self.default_group_size)
        return self.pending[group_id]

    def add_trajectory(self, trajectory: Trajectory, seq: int, now: float) -> None:
        if trajectory.trajectory_id in self.used:
            return
        group = self._group(trajectory.group_id, now)
        if trajectory.group_size:
            group.size = trajectory.group_size
        member = group.members.setdefault(trajectory.trajectory_id, Member())
        if member.trajectory is None:  # a redelivered duplicate changes nothing
            member.trajectory, member.trajectory_seq = trajectory, seq

    def add_reward(self, reward: Reward, seq: int, now: float) -> None:
        if reward.trajectory_id in self.used:
            return
        group = self._group(reward.group_id, now)
        member = group.members.setdefault(reward.trajectory_id, Member())
        if member.reward is None:
            member.reward, member.reward_seq = reward, seq

    def ready(self) -> bool:
        return sum(1 for g in self.pending.values() if g.complete()) >= self.groups_per_batch

    def take_batch(self) -> list[GroupBatchItem] | None:
        complete = sorted(
            (g for g in self.pending.values() if g.complete()), key=lambda g: (g.completed_at_seq(), g.group_id)
        )
        if len(complete) < self.groups_per_batch:
            return None
        batch = []
        for group in complete[: self.groups_per_batch]:
            del self.pending[group.group_id]
            batch.append(self._item(group))
        return batch

    def _item(self, group: PendingGroup) -> GroupBatchItem:
        members = sorted(
            (m for m in group.members.values() if m.trajectory is not None and m.reward is not None),
            key=lambda m: m.trajectory.sample_index,  # type: ignore[union-attr]
        )[: group.size]
        for m in members:
            self.used.add(m.trajectory.trajectory_id)  # type: ignore[union-attr]
        return GroupBatchItem(
            group_id=group.group_id,
            trajectories=[m.trajectory for m in members],  # type: ignore[misc]
            rewards=[m.reward for m in members],  # type: ignore[misc]
            trajectory_seqs=[m.trajectory_seq for m in members],
            reward_seqs=[m.reward_seq for m in members],
        )

    def overdue(self, now: float) -> list[PendingGroup]:
        """Incomplete groups older than max_wait_s. Not removed: whether one is dropped is the log's word
        (`drop`, or `defer` when the log holds more of it than the feeds have delivered)."""
        return [g for g in self.pending.values() if not g.complete() and now - g.first_seen > self.max_wait_s]

    def defer(self, group_id: str, now: float) -> None:
        """Wait another max_wait_s for a group the feeds are behind on."""
        group = self.pending[group_id]
        group.first_seen, group.deferred_at = now, group.counts()

    def drop(self, group_id: str, in_log: tuple[int, int] | None = None) -> tuple[PendingGroup, str]:
        """Remove an incomplete group for good (its ids count as used) and say why; `in_log`: how many
        trajectories and rewards of it the log holds."""
        group = self.pending.pop(group_id)
        have_traj, have_reward = group.counts()
        reason = (
            f"incomplete after {self.max_wait_s:.0f}s: {have_traj}/{group.size} trajectories, "
            f"{have_reward}/{group.size} rewards"
        )
        if in_log is not None:
            reason += f"; the log holds {in_log[0]} trajectories and {in_log[1]} rewards of it"
        self.used.update(group.members)
        return group, reason

    def expire(self, now: float) -> list[tuple[PendingGroup, str]]:
        """Drop every overdue group without asking the log (for callers that have none)."""
        return [self.drop(group.group_id) for group in self.overdue(now)]

    def positions(self, next_traj: int, next_reward: int) -> tuple[int, int]:
        """Where a restart must re-read from so that nothing pending is lost."""
        traj = [s for g in self.pending.values() if (s := g.min_seq("trajectory")) is not None]
        reward = [s for g in self.pending.values() if (s := g.min_seq("reward")) is not None]
        return (min([next_traj, *traj]), min([next_reward, *reward]))
