"""Subject names: `rl.<run>.<kind>[.<qualifier>]`, lowercase, one place that builds them."""

from __future__ import annotations

import functools
import re

from schemas import (
    ClaimCheck,
    DeadLetter,
    Event,
    GroupDropped,
    IslandHeartbeat,
    PolicyVersion,
    PromptGroup,
    Reward,
    TrainerCheckpoint,
    TrainerLease,
    TrainerMetrics,
    Trajectory,
)

_TOKEN = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


@functools.lru_cache(maxsize=4096)  # run and group ids repeat; append is on the hot path
def token(value: str, what: str) -> str:
    """Validate one subject token; ids become tokens, so a dot or space would split or break a subject."""
    lowered = value.lower()
    if not _TOKEN.match(lowered):
        raise ValueError(
            f"{what} {value!r} cannot be a subject token: use letters, digits, '_' or '-' "
            "(no dots, spaces or wildcards)"
        )
    return lowered


def policy_subject(run_id: str, version: int) -> str:
    return f"rl.{token(run_id, 'run_id')}.policy.v{version}"


def policy_filter(run_id: str) -> str:
    """All versions of a run's chain: the fence for create-only version appends."""
    return f"rl.{token(run_id, 'run_id')}.policy.*"


def prompts_subject(run_id: str) -> str:
    return f"rl.{token(run_id, 'run_id')}.prompts"


def trajectories_filter(run_id: str) -> str:
    return f"rl.{token(run_id, 'run_id')}.traj.>"


def rewards_filter(run_id: str) -> str:
    return f"rl.{token(run_id, 'run_id')}.reward.>"


def subject_for(event: Event) -> str:
    run = token(event.run_id, "run_id")
    match event:
        case PolicyVersion():
            return policy_subject(run, event.version)
        case PromptGroup():
            return prompts_subject(run)
        case Trajectory():
            return f"rl.{run}.traj.{token(event.group_id, 'group_id')}"
        case Reward():
            return f"rl.{run}.reward.{token(event.group_id, 'group_id')}"
        case IslandHeartbeat():
            return f"rl.{run}.heartbeat.{token(event.island.island_id, 'island_id')}"
        case TrainerMetrics():
            return f"rl.{run}.metrics.trainer"
        case DeadLetter():
            return f"rl.{run}.deadletter.{token(event.stream, 'stream')}"
        case TrainerCheckpoint():
            return f"rl.{run}.trainer.checkpoint"
        case GroupDropped():
            return f"rl.{run}.trainer.dropped"
        case TrainerLease():
            return f"rl.{run}.trainer.lease"
        case ClaimCheck():
            raise ValueError("a claim check travels on the subject of the event it stands in for")
    raise ValueError(f"no subject is defined for event type {type(event).type_tag()}")
