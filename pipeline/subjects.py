"""Which subject each event travels on: `rl.<run>.<kind>[.<qualifier>]`, built from the grammar in
`pipeline/topology.py` (the same data the streams are declared from)."""

from __future__ import annotations

from pipeline.topology import (
    Kind,
    group_rewards_filter,
    group_trajectories_filter,
    policy_filter,
    rewards_filter,
    run_subject,
    token,
    trajectories_filter,
)
from schemas import (
    ClaimCheck,
    DeadLetter,
    Event,
    GroupDropped,
    IslandDrift,
    IslandHeartbeat,
    PolicyVersion,
    PromptGroup,
    Reward,
    StabilityResult,
    TrainerCheckpoint,
    TrainerLease,
    TrainerMetrics,
    Trajectory,
)

# Filters and the token check live with the topology; re-exported for the modules that import them here.
__all__ = [
    "dead_letter_subject",
    "group_dropped_subject",
    "group_rewards_filter",
    "group_trajectories_filter",
    "policy_filter",
    "policy_subject",
    "prompts_subject",
    "reward_subject",
    "rewards_filter",
    "subject_for",
    "token",
    "trainer_checkpoint_subject",
    "trainer_lease_subject",
    "trajectories_filter",
    "trajectory_subject",
]


def _run(run_id: str) -> str:
    return token(run_id, "run_id")


def policy_subject(run_id: str, version: int) -> str:
    return run_subject(_run(run_id), Kind.POLICY, f"v{version}")


def prompts_subject(run_id: str) -> str:
    return run_subject(_run(run_id), Kind.PROMPTS)


def trajectory_subject(run_id: str, group_id: str, trajectory_id: str) -> str:
    """One subject per trajectory, so the server stores a trajectory once, whatever its message id."""
    return run_subject(
        _run(run_id), Kind.TRAJECTORIES, token(group_id, "group_id"), token(trajectory_id, "trajectory_id")
    )


def reward_subject(run_id: str, group_id: str, trajectory_id: str) -> str:
    """One subject per rewarded trajectory: a trajectory gets one reward, whoever scores it."""
    return run_subject(_run(run_id), Kind.REWARDS, token(group_id, "group_id"), token(trajectory_id, "trajectory_id"))


def dead_letter_subject(run_id: str, stream: str, original_seq: int) -> str:
    """One subject per refused message (its stream and sequence): however many consumers refuse it,
    the log keeps one dead letter."""
    return run_subject(_run(run_id), Kind.DEAD_LETTERS, token(stream, "stream"), str(original_seq))


def trainer_checkpoint_subject(run_id: str) -> str:
    return run_subject(_run(run_id), Kind.TRAINER, "checkpoint")


def trainer_lease_subject(run_id: str) -> str:
    return run_subject(_run(run_id), Kind.TRAINER, "lease")


def group_dropped_subject(run_id: str) -> str:
    return run_subject(_run(run_id), Kind.TRAINER, "dropped")


def subject_for(event: Event) -> str:
    run = _run(event.run_id)
    match event:
        case PolicyVersion():
            return policy_subject(run, event.version)
        case PromptGroup():
            return prompts_subject(run)
        case Trajectory():
            return trajectory_subject(run, event.group_id, event.trajectory_id)
        case Reward():
            return reward_subject(run, event.group_id, event.trajectory_id)
        case IslandHeartbeat():
            return run_subject(run, Kind.HEARTBEATS, token(event.island.island_id, "island_id"))
        case TrainerMetrics():
            return run_subject(run, Kind.METRICS, "trainer")
        case IslandDrift():
            return run_subject(run, Kind.METRICS, "drift")
        case StabilityResult():
            return run_subject(run, Kind.METRICS, "stability")
        case DeadLetter():
            return dead_letter_subject(run, event.stream, event.original_seq)
        case TrainerCheckpoint():
            return trainer_checkpoint_subject(run)
        case GroupDropped():
            return group_dropped_subject(run)
        case TrainerLease():
            return trainer_lease_subject(run)
        case ClaimCheck():
            raise ValueError("a claim check travels on the subject of the event it stands in for")
    raise ValueError(f"no subject is defined for event type {type(event).type_tag()}")
