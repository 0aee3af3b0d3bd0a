"""What the trainer refuses before a trajectory joins a batch: ids this model cannot index.

The decoder checks a trajectory's shape, not that its token ids exist in this model's vocabulary (or
its expert ids among this model's experts). A forged or broken trajectory with an id out of range
made `run_update` raise IndexError; the batch was not in any lineage yet, so the restarted trainer
read the same trajectory and crashed again, for ever. Refused here instead: dead-lettered with the
reason, and its group, never complete, is dropped like any incomplete group.
"""

from __future__ import annotations

from itertools import chain

from schemas import DeadLetter, Trajectory, encode_event
from schemas.envelope import new_event_id, now_utc


def refusal(trajectory: Trajectory, vocab_size: int, num_experts: int | None) -> str | None:
    """Why this model cannot train on `trajectory`, or None."""
    ids = chain(
        trajectory.prompt_token_ids,
        trajectory.output_token_ids,
        *trajectory.top_logprob_ids,
        *(trajectory.top_p_kept_ids or []),
    )
    highest = max(ids, default=-1)
    if highest >= vocab_size:
        return f"token id {highest} is outside the model's vocabulary of {vocab_size}"
    if num_experts is not None and trajectory.routed_experts:
        experts = max((e for position in trajectory.routed_experts for layer in position for e in layer), default=-1)
        if experts >= num_experts:
            return f"expert id {experts} is outside the model's {num_experts} experts"
    return None


def refused_trajectory(
    trajectory: Trajectory, *, reason: str, run_id: str, consumer: str, subject: str, seq: int
) -> DeadLetter:
    return DeadLetter(
        run_id=run_id,
        event_id=new_event_id(),
        produced_at=now_utc(),
        reason=reason,
        error_class="TrajectoryOutOfModel",
        stream="trajectories",
        consumer=consumer,
        original_subject=subject,
        original_seq=seq,
        num_delivered=1,
        payload=encode_event(trajectory),
    )
