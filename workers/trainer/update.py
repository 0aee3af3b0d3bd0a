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
import torch.distributed as dist

from pipeline.batching import GroupBatchItem
from pipeline.off_policy import grpo_advantages, policy_loss
from pipeline.routing_replay import replay_routing
from schemas import Trajectory
from workers.trainer.distributed import RankContext, RanksMisconfigured, clip_gradients
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

    def to(self, device: torch.device) -> BatchTensors:
        """The same tensors on `device` (itself on CPU)."""
        if device.type == "cpu":
            return self
        return BatchTensors(
            *(None if t is None else t.to(device) for t in (getattr(self, f) for f in self.__dataclass_fields__))
        )


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


@dataclass
class SliceResult:
    """One slice's per-token quantities for the metrics (CPU tensors, rows in batch order)."""

    rows: list[int]
    measured: _Measured
    loss_mask: torch.Tensor
    measured_mask: torch.Tensor
    staleness: torch.Tensor
    loss: float


def slice_bounds(groups: int, slices: int) -> list[tuple[int, int]]:
    """`slices` contiguous runs of the batch's groups, as even as they can be (a group is never cut:
    GRPO's advantages are per group, and a slice is what one rank computes)."""
    return [(groups * i // slices, groups * (i + 1) // slices) for i in range(slices)]


def run_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: list[GroupBatchItem],
    cfg: TrainerSection,
    trainer_version: int,
    quarantined: frozenset[str] = frozenset(),
    ctx: RankContext | None = None,
) -> UpdateMetrics | None:
    """Forward, corrected loss, backward, step, as `cfg` says (its loss, GRPO normalization, gradient
    clipping, routing replay, staleness bound, precision and slices). Returns overall, per-group and
    per-island metrics (on the leading rank; None on the others).

    The batch is cut into slices (`cfg.micro_batches`, one per rank by default); each rank computes the
    gradients of its own slices one after another, and they are summed. The loss of every slice is
    divided by the whole batch's normalizer, so the sum is the gradient of the batch's loss, and the
    same slices give the same bits on one rank or several (`distributed.py`).

    `quarantined`: islands the drift guard excluded. Their rows' loss mask is zeroed, so they add nothing
    to the gradient (nor to the loss's token count); their sampler-trainer KL is still measured (a
    no-grad pass of the same loss over just those rows) so the guard can see them recover. The set is
    an input like the batch: recovery replays a version with the set its lineage recorded."""
    ctx = ctx or RankContext()
    started = time.perf_counter()
    trajectories = [t for item in batch for t in item.trajectories]
    rewards = torch.tensor([[r.value for r in item.rewards] for item in batch], dtype=torch.float32)
    advantages = grpo_advantages(rewards, normalize_std=cfg.normalize_std).reshape(-1)
    vocab = model.config.vocab_size
    slices = slice_count(cfg, ctx)
    # Every rank builds every slice's tensors (cheap next to a forward pass): the normalizer and "is
    # there any token to learn from" then need no communication, and every rank agrees on them.
    planned = []
    first_row = 0
    excluded_all = quarantine_rows(trajectories, quarantined)
    for lo, hi in slice_bounds(len(batch), slices):
        rows = list(range(first_row, first_row + sum(len(item.trajectories) for item in batch[lo:hi])))
        first_row = rows[-1] + 1 if rows else first_row
        bt = build_tensors(
            [trajectories[i] for i in rows], vocab, trainer_version, cfg.max_staleness, cfg.train_temperature
        )
        measured_mask = bt.loss_mask
        excluded = [rows.index(i) for i in excluded_all if i in rows]
        if excluded:
            bt.loss_mask = measured_mask.clone()
            bt.loss_mask[excluded] = False
        planned.append((rows, bt, measured_mask, excluded))
    if cfg.loss.length_normalization:
        normalizer = float(max(sum(int((bt.loss_mask.sum(-1) > 0).sum()) for _, bt, _, _ in planned), 1))
    else:
        normalizer = float(max(sum(int(bt.loss_mask.sum()) for _, bt, _, _ in planned), 1))
    learns = any(bool(bt.loss_mask.any()) for _, bt, _, _ in planned) or not excluded_all

    model.train()
    optimizer.zero_grad(set_to_none=True)
    per_rank = slices // ctx.world_size
    results = []
    for index in range(ctx.rank * per_rank, (ctx.rank + 1) * per_rank):
        rows, bt, measured_mask, excluded = planned[index]
        results.append(
            _slice_forward_backward(
                model, bt, advantages[rows], measured_mask, excluded, rows, cfg, normalizer, learns, ctx
            )
        )
    if not learns:
        # Quarantine left no token in the loss: no step at all. A step on zero gradients still moves
        # every weight (Adam's momentum from earlier updates, weight decay), so the version would change
        # without anything having been learned from this batch. Without gradients the optimizer skips
        # every parameter (its state, step counts included, stays as it was).
        grad_norm = 0.0
    else:
        grad_norm = clip_gradients(list(model.parameters()), cfg.max_grad_norm, ctx)
        optimizer.step()
    if ctx.distributed:
        gathered: list[list[SliceResult]] | None = [[] for _ in range(ctx.world_size)] if ctx.is_leader else None
        dist.gather_object(results, gathered, dst=0)
        if not ctx.is_leader:
            return None
        assert gathered is not None
        results = [r for rank_results in gathered for r in rank_results]
    elapsed = time.perf_counter() - started
    return _update_metrics(batch, trajectories, rewards, results, excluded_all, grad_norm, elapsed)


def slice_count(cfg: TrainerSection, ctx: RankContext) -> int:
    slices = cfg.micro_batches or ctx.world_size
    if slices % ctx.world_size:
        raise RanksMisconfigured(
            f"trainer.micro_batches = {slices} cannot be split over {ctx.world_size} ranks",
            hint="make micro_batches a multiple of the number of ranks (or leave it unset: one per rank)",
        )
    if slices > cfg.groups_per_batch:
        raise RanksMisconfigured(
            f"{slices} slices (over {ctx.world_size} ranks) for batches of {cfg.groups_per_batch} groups:"
            " a slice holds whole groups",
            hint="raise trainer.groups_per_batch to at least the number of slices, or use fewer ranks",
        )
    return slices


def _slice_forward_backward(
    model, bt: BatchTensors, advantages, measured_mask, excluded, rows, cfg: TrainerSection, normalizer, learns, ctx
) -> SliceResult:
    device = ctx.device
    on = bt.to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
    with autocast:
        if cfg.routing_replay and on.routed is not None and on.routed_valid is not None:
            with replay_routing(model, on.routed, on.routed_valid):
                logits = model(input_ids=on.input_ids, attention_mask=on.attention_mask).logits
        else:
            logits = model(input_ids=on.input_ids, attention_mask=on.attention_mask).logits
    out_logits = logits.gather(1, on.positions[..., None].expand(-1, -1, logits.shape[-1]))
    out_logits = out_logits.float() / on.temperature[:, None, None]
    advantages = advantages.to(device)
    result = policy_loss(
        out_logits,
        on.targets,
        advantages,
        on.loss_mask,
        on.sampler_logp,
        cfg.loss,
        temperature=1.0,
        kept=on.kept,
        top_ids=on.top_ids,
        top_logp=on.top_logp,
        top_valid=on.top_valid,
        normalizer=normalizer,
    )
    measured = _measure_excluded(result, out_logits, advantages, on, measured_mask.to(device), excluded, cfg)
    if learns:
        result.loss.backward()
    return SliceResult(
        rows=rows,
        measured=measured.to("cpu"),
        loss_mask=bt.loss_mask,
        measured_mask=measured_mask,
        staleness=bt.staleness,
        loss=float(result.loss.detach()),
    )


def _update_metrics(
    batch, trajectories, rewards, results: list[SliceResult], excluded, grad_norm, elapsed
) -> UpdateMetrics:
    """The metrics of the whole batch from its slices' per-token quantities (padded to one length)."""
    width = max(r.loss_mask.shape[1] for r in results)

    def cat(get) -> torch.Tensor:
        return torch.cat([_pad(get(r), width) for r in results])

    measured = _Measured(*(cat(lambda r, f=f: getattr(r.measured, f)) for f in _Measured.__dataclass_fields__))
    loss_mask, measured_mask = cat(lambda r: r.loss_mask), cat(lambda r: r.measured_mask)
    staleness = cat(lambda r: r.staleness)
    flat_rewards = rewards.reshape(-1)
    reward_events = [item_r for item in batch for item_r in item.rewards]
    overall = _metrics(  # `measured` is the loss's own on every row the loss used
        measured, loss_mask, staleness, flat_rewards, reward_events, trajectories, range(len(trajectories))
    )
    overall |= {
        "loss": sum(r.loss for r in results),
        "grad_norm": grad_norm if math.isfinite(grad_norm) else -1.0,
        "tokens_per_s": float(loss_mask.sum()) / max(elapsed, 1e-9),
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
            name: _metrics(measured, measured_mask, staleness, flat_rewards, reward_events, trajectories, members)
            for name, members in rows.items()
        }

    per_group = by(lambda t: t.island.group or t.island.view)
    per_island = by(lambda t: t.island.island_id)
    for island, members in _identities(trajectories).items():
        per_island[island]["identities"] = float(len(members))
    overall, per_group, per_island = _finite_only(overall, per_group, per_island)
    return UpdateMetrics(overall, per_group, per_island)


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


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

    def to(self, device) -> _Measured:
        return _Measured(*(getattr(self, f).detach().to(device) for f in self.__dataclass_fields__))


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
