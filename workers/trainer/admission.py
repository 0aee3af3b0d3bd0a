"""What the trainer refuses before a trajectory joins a batch: ids this model cannot index, and
sequences longer than it takes.

The decoder checks a trajectory's shape, not that its token ids exist in this model's vocabulary (or
its expert ids among this model's experts). A forged or broken trajectory with an id out of range
made `run_update` raise IndexError; the batch was not in any lineage yet, so the restarted trainer
read the same trajectory and crashed again, for ever. Refused here instead: dead-lettered with the
reason, and its group, never complete, is dropped like any incomplete group.

Expert routes are checked against the model's MoE family (`pipeline.moe_families.routing_shape`): the
number of MoE layers, k, the expert count (which Mixtral's and GPT-OSS's configs call
`num_local_experts`, DeepSeek-V3's `n_routed_experts`), and no expert twice in one position.
"""

from __future__ import annotations

from itertools import chain

from pipeline.moe_families import RoutingShape
from schemas import DeadLetter, Trajectory, encode_event
from schemas.envelope import new_event_id, now_utc


def refusal(
    trajectory: Trajectory,
    vocab_size: int,
    num_experts: int | None = None,
    *,
    routing: RoutingShape | None = None,
    max_positions: int | None = None,
) -> str | None:
    """Why this model cannot train on `trajectory`, or None.

    `max_positions`: the longest sequence the model takes (its config's `max_position_embeddings`, which
    prompts are rendered to fit with their `max_new_tokens`). A forged trajectory of a million tokens
    (the claim cap allows hundreds of MiB) would otherwise make the update allocate logits for every
    one of them: an out-of-memory kill, then the same trajectory again after every restart.

    `routing`: the model's `routing_shape(config)` (its MoE family's layers, k and expert count; `DENSE`
    for a dense model), which checks the whole shape of a recorded route; `num_experts` alone (the old
    call) checks only the expert ids, and only for a family whose config names them `num_experts`."""
    length = len(trajectory.prompt_token_ids) + len(trajectory.output_token_ids)
    if max_positions is not None and length > max_positions:
        return f"{length} tokens (prompt and output) are more than the model's {max_positions} positions"
    ids = chain(
        trajectory.prompt_token_ids,
        trajectory.output_token_ids,
        *trajectory.top_logprob_ids,
        *(trajectory.top_p_kept_ids or []),
    )
    highest = max(ids, default=-1)
    if highest >= vocab_size:
        return f"token id {highest} is outside the model's vocabulary of {vocab_size}"
    if routing is not None:
        return route_refusal(trajectory.routed_experts, routing)
    if num_experts is not None and trajectory.routed_experts:
        experts = max((e for position in trajectory.routed_experts for layer in position for e in layer), default=-1)
        if experts >= num_experts:
            return f"expert id {experts} is outside the model's {num_experts} experts"
    return None


def route_refusal(routed: list[list[list[int]]] | None, routing: RoutingShape) -> str | None:
    """Why a recorded route cannot be this model's: per position, one list per MoE layer of k distinct
    expert ids in range. Ragged or out-of-range routes made building the batch raise (or, replayed,
    route a token to an expert transformers silently drops), for ever on restart."""
    if not routed:
        return None
    if routing.layers == 0:
        return "the trajectory records expert routes, but the model has no MoE layer"
    for position, layers in enumerate(routed):
        if len(layers) != routing.layers:
            return f"position {position} records {len(layers)} MoE layers, the model has {routing.layers}"
        for layer, experts in enumerate(layers):
            if len(experts) != routing.top_k:
                return f"position {position}, MoE layer {layer} picks {len(experts)} experts, the model {routing.top_k}"
            if any(e < 0 or e >= routing.experts for e in experts):
                return (
                    f"position {position}, MoE layer {layer}: expert ids {experts} are not all within the model's "
                    f"{routing.experts} experts"
                )
            if len(set(experts)) != len(experts):
                return f"position {position}, MoE layer {layer} names an expert twice: {experts}"
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
