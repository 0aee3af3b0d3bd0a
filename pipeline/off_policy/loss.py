"""The loss core: off-policy corrected policy-gradient losses (the formula sheet is `OFF_POLICY.md`).

Shapes: B sequences, T output positions (padded), V vocabulary, K top-k entries per position.
Every importance weight is stop-gradient. Masked tokens leave the numerator of the loss mean;
the denominator stays the number of loss tokens before masking, so masking never rescales a step.

The corrections themselves live in `corrections/`, one module each, and are called here at their
stage (`hooks.py`) when the `LossSection` switches them on (`registry.py`). The order of operations
is fixed: results are bit-identical run to run, which recovery by replay relies on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from pipeline.off_policy.hooks import (
    ImportanceWeight,
    ScoreTerm,
    SequenceFilter,
    SequenceLevel,
    Support,
    Surrogate,
    TokenWeight,
)
from pipeline.off_policy.registry import CORRECTIONS, load_hook
from pipeline.off_policy.settings import LossSection

NEG_INF = float("-inf")


class PolicyGradient(Surrogate):
    """The plain surrogate, -A w log pi(y), in force unless a correction brings another."""

    def per_token(self, logp, adv, weight, cfg, old_logp):
        return -adv * weight * logp


@dataclass(frozen=True)
class LossPlan:
    """The hooks in force for one `LossSection`, by stage."""

    support: Support | None = None
    importance: ImportanceWeight | None = None
    sequence: SequenceLevel | None = None
    filters: tuple[SequenceFilter, ...] = ()
    surrogate: Surrogate = field(default_factory=PolicyGradient)
    terms: tuple[ScoreTerm, ...] = ()


@functools.lru_cache(maxsize=64)
def loss_plan(cfg: LossSection) -> LossPlan:
    """Which correction hooks `cfg` switches on, by stage (cached: sections are frozen)."""
    stages: dict[str, object] = {}
    filters: list[SequenceFilter] = []
    terms: list[ScoreTerm] = []
    for correction in CORRECTIONS.values():
        if not correction.active(cfg):
            continue
        hook = load_hook(correction)
        if hook is None:
            continue
        if isinstance(hook, SequenceFilter):
            filters.append(hook)
        elif isinstance(hook, ScoreTerm):
            terms.append(hook)
        else:
            stage = next(
                (name for name, base in _SINGLE_STAGES.items() if isinstance(hook, base)),
                None,
            )
            if stage is None:
                raise TypeError(f"correction {correction.name!r}: {type(hook).__name__} is not a hook of any stage")
            if stage in stages:
                raise ValueError(f"correction {correction.name!r}: a second {stage} hook is switched on")
            stages[stage] = hook
    return LossPlan(**stages, filters=tuple(filters), terms=tuple(terms))  # type: ignore[arg-type]


_SINGLE_STAGES = {
    "support": Support,
    "importance": ImportanceWeight,
    "sequence": SequenceLevel,
    "surrogate": Surrogate,
}


def processed_logprobs(logits: torch.Tensor, temperature: float, kept: torch.Tensor | None) -> torch.Tensor:
    """log pi over the processed distribution: logits / T, renormalized over the kept set when replayed."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    if kept is not None:
        scaled = scaled.masked_fill(~kept, NEG_INF)
    return torch.log_softmax(scaled, dim=-1)


def _token_weight(plan: LossPlan, cfg: LossSection) -> TokenWeight:
    """w(x) per token with masks of what it dropped below / above its range: the importance weight when
    it applies per token, else ones."""

    def weight(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if plan.importance is None or plan.sequence is not None:
            low = torch.zeros_like(x, dtype=torch.bool)
            high = torch.zeros_like(x, dtype=torch.bool)
            return torch.ones_like(x), low, high
        return plan.importance.token_weight(x, cfg)

    return weight


@dataclass
class LossOutput:
    loss: torch.Tensor
    logp: torch.Tensor
    """[B, T] log pi of the sampled tokens (with grad)."""
    rho: torch.Tensor
    """[B, T] pi/mu of the sampled tokens (detached)."""
    weight: torch.Tensor
    """[B, T] the importance weight applied (detached, includes sequence-level weights and rejections)."""
    masked_low: torch.Tensor
    masked_high: torch.Tensor
    entropy: torch.Tensor
    """[B, T] entropy of pi (detached)."""


def policy_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    sampler_logp: torch.Tensor,
    cfg: LossSection,
    *,
    temperature: float = 1.0,
    kept: torch.Tensor | None = None,
    top_ids: torch.Tensor | None = None,
    top_logp: torch.Tensor | None = None,
    top_valid: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> LossOutput:
    """logits [B,T,V] at the positions that predicted `targets` [B,T]; advantages [B]; loss_mask [B,T]
    (bool); sampler_logp [B,T] log mu(y); kept [B,T,V] the sampler's kept set (mask replay);
    top_ids/top_logp/top_valid [B,T,K] the sampler's top-k of mu (score centering); old_logp [B,T]
    log pi_old for PPO's proximal ratio. `normalizer`: what the summed loss is divided by (the token
    count, or with length normalization the count of sequences with a token) when these rows are one
    slice of a larger batch; None: this batch's own."""
    plan = loss_plan(cfg)
    token_weight = _token_weight(plan, cfg)
    mask = loss_mask.bool()
    logp_all = processed_logprobs(logits, temperature, plan.support.kept(kept) if plan.support else None)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(mask, logp, torch.zeros_like(logp))
    with torch.no_grad():
        log_rho = torch.where(mask, logp.detach() - sampler_logp, torch.zeros_like(logp))
        rho = log_rho.exp()
        w_tok, low, high = token_weight(rho)
        keep_seq = torch.ones_like(advantages, dtype=torch.bool)
        w_seq = torch.ones_like(advantages)
        if plan.importance is not None and plan.sequence is not None:
            w_seq = plan.importance.sequence_weight(plan.sequence.ratio(log_rho), cfg)
        for sequence_filter in plan.filters:
            keep_seq = keep_seq & sequence_filter.keep(log_rho, mask, cfg)
        weight = w_tok * w_seq[:, None] * keep_seq[:, None]
        probs = logp_all.detach().exp()
        entropy = -(probs * torch.where(probs > 0, logp_all.detach(), torch.zeros_like(probs))).sum(-1)
    adv = advantages[:, None].to(logp.dtype)
    per_token = plan.surrogate.per_token(logp, adv, weight, cfg, old_logp)
    for term in plan.terms:
        per_token = per_token + adv * term.per_token(logp_all, cfg, top_ids, top_logp, top_valid, token_weight) * (
            w_seq[:, None] * keep_seq[:, None]
        )
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    if cfg.length_normalization:
        per_seq = per_token.sum(-1) / mask.sum(-1).clamp(min=1)
        loss = per_seq.sum() / (normalizer if normalizer is not None else max(int((mask.sum(-1) > 0).sum()), 1))
    else:
        loss = per_token.sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1))
    return LossOutput(loss, logp, rho, weight, low & mask, high & mask, entropy)


def full_vocab_centering_loss(logits, targets, advantages, mu_all, temperature=1.0) -> torch.Tensor:
    """Reference SC loss without IS over the full vocabulary: -A (log pi(a) - sum_v sg(mu_v) log pi(v))."""
    logp_all = processed_logprobs(logits, temperature, None)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    corr = (mu_all.detach() * logp_all).sum(-1)
    return (-advantages[:, None] * (logp - corr)).sum()


def grpo_advantages(rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, n] -> advantages [G, n]: reward minus the group mean (divided by the group std)."""
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if normalize_std:
        centered = centered / (rewards.std(dim=-1, keepdim=True, unbiased=False) + eps)
    return centered
