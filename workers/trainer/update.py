"""One trainer update: a batch of prompt groups -> tensors -> corrected loss -> optimizer step -> metrics.

Kept apart from the worker loop so that the live path and the recovery replay run the exact same
code, which is what makes a resumed run's versions bit-identical to an uninterrupted run's.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pipeline.batching import GroupBatchItem
from pipeline.off_policy import grpo_advantages, policy_loss
from pipeline.routing_replay import replay_routing
from schemas import Trajectory
from workers.trainer.settings import TrainerSection

STALENESS_BUCKETS = {
    "staleness_0": (0, 0),
    "staleness_1": (1, 1),
    "staleness_2": (2, 2),
    "staleness_3_4": (3, 4),
    "staleness_5_8": (5, 8),
    "staleness_9_plus": (9, 1 << 30),
}
"""Histogram of per-token staleness (trainer version minus the version that produced the token)."""

LOG_RATIO_BOUND = 50.0
"""The per-token log(pi/mu) the KL metrics use is clamped to +-this. A broken or hostile island's
logprob can be anything: -1e300 is valid JSON and -inf in float32, and a token the trainer gives
exp(-120) underflows pi/mu to 0; either way k3 would be inf or NaN, which the log cannot carry (a
TrainerMetrics with one would not decode) and which blinds every comparison. e^50 ~ 5e21 per token is
far above any drift threshold, and sums of it stay finite."""


@dataclass
class BatchTensors:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    positions: torch.Tensor
    """[B, T] index into the model's sequence of the logits that predict output token t."""
    targets: torch.Tensor
    loss_mask: torch.Tensor
    sampler_logp: torch.Tensor
    temperature: torch.Tensor
    kept: torch.Tensor | None
    top_ids: torch.Tensor
    top_logp: torch.Tensor
    top_valid: torch.Tensor
    staleness: torch.Tensor
    routed: torch.Tensor | None
    routed_valid: torch.Tensor | None


def token_staleness(trajectory: Trajectory, trainer_version: int) -> list[int]:
    staleness = [0] * len(trajectory.output_token_ids)
    for span in trajectory.version_spans:
        for t in range(span.start, min(span.end, len(staleness))):
            staleness[t] = max(0, trainer_version - span.version)
    return staleness


def build_tensors(
    trajectories: list[Trajectory],
    vocab: int,
    trainer_version: int,
    max_staleness: int | None,
    train_temperature: float | None = None,
) -> BatchTensors:
    batch = len(trajectories)
    seq_len = max(len(t.prompt_token_ids) + len(t.output_token_ids) - 1 for t in trajectories)
    out_len = max(len(t.output_token_ids) for t in trajectories)
    k = max([len(ids) for t in trajectories for ids in t.top_logprob_ids] + [1])
    input_ids = torch.zeros(batch, seq_len, dtype=torch.long)
    attention = torch.zeros(batch, seq_len, dtype=torch.long)
    positions = torch.zeros(batch, out_len, dtype=torch.long)
    targets = torch.zeros(batch, out_len, dtype=torch.long)
    mask = torch.zeros(batch, out_len, dtype=torch.bool)
    sampler_logp = torch.zeros(batch, out_len)
    temperature = torch.ones(batch)
    top_ids = torch.zeros(batch, out_len, k, dtype=torch.long)
    top_logp = torch.zeros(batch, out_len, k)
    top_valid = torch.zeros(batch, out_len, k, dtype=torch.bool)
    staleness = torch.zeros(batch, out_len, dtype=torch.long)
    kept = torch.zeros(batch, out_len, vocab, dtype=torch.bool) if any(t.top_p_kept_ids for t in trajectories) else None
    routed_any = all(t.routed_experts for t in trajectories)
    routed = routed_valid = None
    if routed_any:
        layers, experts = len(trajectories[0].routed_experts[0]), len(trajectories[0].routed_experts[0][0])
        routed = torch.zeros(batch, seq_len, layers, experts, dtype=torch.long)
        routed_valid = torch.zeros(batch, seq_len, dtype=torch.bool)
    for i, t in enumerate(trajectories):
        tokens = t.prompt_token_ids + t.output_token_ids
        n_in, prompt, out = len(tokens) - 1, len(t.prompt_token_ids), len(t.output_token_ids)
        input_ids[i, :n_in] = torch.tensor(tokens[:-1])
        attention[i, :n_in] = 1
        positions[i, :out] = torch.arange(prompt - 1, prompt - 1 + out)
        targets[i, :out] = torch.tensor(t.output_token_ids)
        sampler_logp[i, :out] = torch.tensor(t.logprobs)
        if train_temperature is not None:
            temperature[i] = train_temperature
        else:
            temperature[i] = t.sampling.temperature if t.sampling.temperature > 0 else 1.0
        stale = token_staleness(t, trainer_version)
        staleness[i, :out] = torch.tensor(stale)
        loss_mask = t.loss_mask if t.loss_mask is not None else [1] * out
        for j in range(out):
            mask[i, j] = bool(loss_mask[j]) and (max_staleness is None or stale[j] <= max_staleness)
        for j, (ids, lps) in enumerate(zip(t.top_logprob_ids, t.top_logprobs, strict=True)):
            top_ids[i, j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            top_logp[i, j, : len(lps)] = torch.tensor(lps)
            top_valid[i, j, : len(ids)] = True
        if kept is not None:
            if t.top_p_kept_ids:
                for j, ids in enumerate(t.top_p_kept_ids):
                    kept[i, j, ids] = True
                # The sampled token was in the set it was sampled from. A kept set without it (a broken
                # or hostile island's) would make its log pi -inf and the loss NaN; with it, an honest
                # trajectory's set is unchanged.
                kept[i, torch.arange(out), targets[i, :out]] = True
            else:
                kept[i, :out] = True
            kept[i, out:] = True
        if routed is not None and routed_valid is not None:
            recorded = torch.tensor(t.routed_experts[:n_in], dtype=torch.long)
            routed[i, : len(recorded)] = recorded
            routed_valid[i, : len(recorded)] = True
    return BatchTensors(
        input_ids,
        attention,
        positions,
        targets,
        mask,
        sampler_logp,
        temperature,
        kept,
        top_ids,
        top_logp,
        top_valid,
        staleness,
        routed,
        routed_valid,
    )


class UpdateMetrics(NamedTuple):
    overall: dict[str, float]
    """Over the tokens the loss used."""
    per_group: dict[str, dict[str, float]]
    """By sampler group (the view unless the island names a group), over every measured token."""
    per_island: dict[str, dict[str, float]]
    """By island id, over every measured token (a quarantined island's too): what the drift guard reads."""


def quarantine_rows(trajectories: list[Trajectory], quarantined: frozenset[str]) -> list[int]:
    """Rows whose island is quarantined: they are forwarded and measured, but leave the loss."""
    return [i for i, t in enumerate(trajectories) if t.island.island_id in quarantined]


def run_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: list[GroupBatchItem],
    cfg: TrainerSection,
    trainer_version: int,
    quarantined: frozenset[str] = frozenset(),
) -> UpdateMetrics:
    """Forward, corrected loss, backward, step, as `cfg` says (its loss, GRPO normalization, gradient
    clipping, routing replay and staleness bound). Returns overall, per-group and per-island metrics.

    `quarantined`: islands the drift guard excluded. Their rows' loss mask is zeroed, so they add nothing
    to the gradient (nor to the loss's token count); their sampler-trainer KL is still measured (a
    no-grad pass of the same loss over just those rows) so the guard can see them recover. The set is
    an input like the batch: recovery replays a version with the set its lineage recorded."""
    started = time.perf_counter()
    trajectories = [t for item in batch for t in item.trajectories]
    rewards = torch.tensor([[r.value for r in item.rewards] for item in batch], dtype=torch.float32)
    advantages = grpo_advantages(rewards, normalize_std=cfg.normalize_std).reshape(-1)
    vocab = model.config.vocab_size
    bt = build_tensors(trajectories, vocab, trainer_version, cfg.max_staleness, cfg.train_temperature)
    measured_mask = bt.loss_mask
    excluded = quarantine_rows(trajectories, quarantined)
    if excluded:
        bt.loss_mask = measured_mask.clone()
        bt.loss_mask[excluded] = False
    model.train()
    if cfg.routing_replay and bt.routed is not None and bt.routed_valid is not None:
        with replay_routing(model, bt.routed, bt.routed_valid):
            logits = model(input_ids=bt.input_ids, attention_mask=bt.attention_mask).logits
    else:
        logits = model(input_ids=bt.input_ids, attention_mask=bt.attention_mask).logits
    out_logits = logits.gather(1, bt.positions[..., None].expand(-1, -1, logits.shape[-1]))
    out_logits = out_logits.float() / bt.temperature[:, None, None]
    result = policy_loss(
        out_logits,
        bt.targets,
        advantages,
        bt.loss_mask,
        bt.sampler_logp,
        cfg.loss,
        temperature=1.0,
        kept=bt.kept,
        top_ids=bt.top_ids,
        top_logp=bt.top_logp,
        top_valid=bt.top_valid,
    )
    measured = _measure_excluded(result, out_logits, advantages, bt, measured_mask, excluded, cfg)
    optimizer.zero_grad(set_to_none=True)
    if excluded and not bool(bt.loss_mask.any()):
        # Quarantine left no token in the loss: no step at all. A step on zero gradients still moves
        # every weight (Adam's momentum from earlier updates, weight decay), so the version would change
        # without anything having been learned from this batch. Without gradients the optimizer skips
        # every parameter (its state, step counts included, stays as it was).
        grad_norm = 0.0
    else:
        result.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        optimizer.step()
    elapsed = time.perf_counter() - started

    flat_rewards = rewards.reshape(-1)
    reward_events = [item_r for item in batch for item_r in item.rewards]
    overall = _metrics(  # `measured` is `result` on every row the loss used
        measured, bt.loss_mask, bt.staleness, flat_rewards, reward_events, trajectories, range(len(trajectories))
    )
    overall |= {
        "loss": float(result.loss.detach()),
        "grad_norm": grad_norm if math.isfinite(grad_norm) else -1.0,
        "tokens_per_s": float(bt.loss_mask.sum()) / max(elapsed, 1e-9),
        "update_s": elapsed,
        "groups": float(len(batch)),
        "trajectories": float(len(trajectories)),
        "quarantined_trajectories": float(len(excluded)),
    }

    def by(key) -> dict[str, dict[str, float]]:
        rows: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(trajectories):
            rows[key(t)].append(i)
        return {
            name: _metrics(measured, measured_mask, bt.staleness, flat_rewards, reward_events, trajectories, members)
            for name, members in rows.items()
        }

    per_group = by(lambda t: t.island.group or t.island.view)
    per_island = by(lambda t: t.island.island_id)
    for island, members in _identities(trajectories).items():
        per_island[island]["identities"] = float(len(members))
    overall, per_group, per_island = _finite_only(overall, per_group, per_island)
    return UpdateMetrics(overall, per_group, per_island)


def _identities(trajectories: list[Trajectory]) -> dict[str, set[tuple[str, ...]]]:
    """Per island id, the distinct samplers that claimed it in the batch. Ids are self-declared (any
    sampler credential may append any trajectory of the run), so the trainer cannot tell which claim is
    true; more than one (another view, accelerator, engine, group or host) is at least visible."""
    out: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    for t in trajectories:
        i = t.island
        host = t.producer.rsplit("/", 1)[0]  # `sampler/<host>/<pid>`: a restarted island keeps its host
        out[i.island_id].add((i.view, i.accelerator, i.engine, i.group, host))
    return out


def _finite_only(overall: dict[str, float], *by_key: dict[str, dict[str, float]]):
    """Every metric without its non-finite values (a NaN loss of a diverged update, say): the log's JSON
    has no NaN or inf, and one of them would make the whole TrainerMetrics undecodable. How many were
    left out is `nonfinite_metrics`."""
    dropped = 0

    def keep(metrics: dict[str, float]) -> dict[str, float]:
        nonlocal dropped
        out = {k: v for k, v in metrics.items() if math.isfinite(v)}
        dropped += len(metrics) - len(out)
        return out

    overall = keep(overall)
    rest = tuple({name: keep(m) for name, m in metrics.items()} for metrics in by_key)
    overall["nonfinite_metrics"] = float(dropped)
    return (overall, *rest)


@dataclass
class _Measured:
    """The per-token quantities `_metrics` reads, for every measured row."""

    rho: torch.Tensor
    log_rho: torch.Tensor
    """float64 log(pi/mu), clamped to +-LOG_RATIO_BOUND (what the KL metrics are computed from)."""
    weight: torch.Tensor
    masked_low: torch.Tensor
    masked_high: torch.Tensor
    entropy: torch.Tensor


def _measure_excluded(result, out_logits, advantages, bt: BatchTensors, measured_mask, excluded, cfg) -> _Measured:
    """`result`'s per-token quantities, with the quarantined rows' filled in by a no-grad pass of the same
    loss over just those rows (the loss zeroes what its mask leaves out, so its own values for them say
    nothing): the same definitions, so a quarantined island's KL compares with everyone else's."""
    measured = _Measured(
        result.rho,
        _log_ratio(result.logp, bt.sampler_logp),
        result.weight,
        result.masked_low,
        result.masked_high,
        result.entropy,
    )
    if not excluded:
        return measured
    rows = torch.tensor(excluded, dtype=torch.long)
    with torch.no_grad():
        shadow = policy_loss(
            out_logits[rows].detach(),
            bt.targets[rows],
            advantages[rows],
            measured_mask[rows],
            bt.sampler_logp[rows],
            cfg.loss,
            temperature=1.0,
            kept=bt.kept[rows] if bt.kept is not None else None,
            top_ids=bt.top_ids[rows],
            top_logp=bt.top_logp[rows],
            top_valid=bt.top_valid[rows],
        )
    for name in ("rho", "weight", "masked_low", "masked_high", "entropy"):
        full = getattr(measured, name).clone()
        full[rows] = getattr(shadow, name)
        setattr(measured, name, full)
    measured.log_rho = measured.log_rho.clone()
    measured.log_rho[rows] = _log_ratio(shadow.logp, bt.sampler_logp[rows])
    return measured


def _log_ratio(logp: torch.Tensor, sampler_logp: torch.Tensor) -> torch.Tensor:
    """log(pi/mu) per token in float64, clamped (`LOG_RATIO_BOUND`; NaN, which only a NaN model makes,
    as the bound too: not measurable reads as far off)."""
    log_rho = logp.detach().double() - sampler_logp.double()
    log_rho = torch.nan_to_num(log_rho, nan=LOG_RATIO_BOUND)
    return log_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _metrics(
    result, loss_mask, staleness, rewards: torch.Tensor, reward_events, trajectories, rows
) -> dict[str, float]:
    rows = list(rows)
    index = torch.tensor(rows, dtype=torch.long)
    mask = loss_mask[index]
    n = int(mask.sum())
    log_rho = result.log_rho[index][mask]
    weight = result.weight[index][mask].double()
    metrics: dict[str, float] = {"tokens": float(n)}
    if n:
        square = float((weight**2).sum())
        ess = float(weight.sum() ** 2 / (n * square)) if 0 < square < math.inf else 0.0
        metrics |= {
            "kl_k1": float((-log_rho).mean()),
            "kl_k3": float((torch.expm1(log_rho) - log_rho).mean()),
            "chi2": float(torch.exp(2 * log_rho).mean() - 1),
            "ess_ratio": ess if math.isfinite(ess) else 0.0,
            "masked_low": float(result.masked_low[index][mask].float().mean()),
            "masked_high": float(result.masked_high[index][mask].float().mean()),
            "entropy": float(result.entropy[index][mask].mean()),
        }
        stale = staleness[index][mask]
        for name, (lo, hi) in STALENESS_BUCKETS.items():
            metrics[name] = float(((stale >= lo) & (stale <= hi)).sum()) / n
        metrics["staleness_mean"] = float(stale.float().mean())
    r = rewards[index]
    metrics |= {"reward_mean": float(r.mean()), "reward_std": float(r.std(unbiased=False))}
    metrics["format_error_rate"] = sum(reward_events[i].format_error for i in rows) / len(rows)
    metrics["truncation_rate"] = sum(trajectories[i].finish_reason == "length" for i in rows) / len(rows)
    return metrics
