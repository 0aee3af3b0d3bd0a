"""Off-policy corrected policy-gradient losses (the formula sheet is `OFF_POLICY.md`).

Shapes: B sequences, T output positions (padded), V vocabulary, K top-k entries per position.
Every importance weight is stop-gradient. Masked tokens leave the numerator of the loss mean;
the denominator stays the number of loss tokens before masking, so masking never rescales a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class LossConfig:
    surrogate: Literal["pg", "ppo"] = "pg"
    ppo_clip: float = 0.2
    importance: Literal["none", "tis", "mis"] = "mis"
    """Importance weights between the trainer (pi) and the sampler (mu)."""
    importance_level: Literal["token", "sequence"] = "token"
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 5.0
    sequence_cap: float = 2.0
    geometric_rejection: bool = False
    geometric_low: float = 0.5
    geometric_high: float = 2.0
    score_centering: bool = True
    mask_replay: bool = True
    length_normalization: bool = False
    """True: every sequence weighs the same (mean over its tokens); False: every token weighs the same."""
    tail_eps: float = 1e-6


def processed_logprobs(logits: torch.Tensor, temperature: float, kept: torch.Tensor | None) -> torch.Tensor:
    """log pi over the processed distribution: logits / T, renormalized over the kept set when replayed."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    if kept is not None:
        scaled = scaled.masked_fill(~kept, NEG_INF)
    return torch.log_softmax(scaled, dim=-1)


def _weight(x: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-level w(x) with masks of what MIS dropped below / above its range."""
    low = torch.zeros_like(x, dtype=torch.bool)
    high = torch.zeros_like(x, dtype=torch.bool)
    if cfg.importance == "none" or cfg.importance_level != "token":
        return torch.ones_like(x), low, high
    if cfg.importance == "tis":
        return torch.clamp(x, max=cfg.tis_cap), low, high
    low, high = x < cfg.mis_low, x > cfg.mis_high
    return torch.where(low | high, torch.zeros_like(x), x), low, high


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
    cfg: LossConfig,
    *,
    temperature: float = 1.0,
    kept: torch.Tensor | None = None,
    top_ids: torch.Tensor | None = None,
    top_logp: torch.Tensor | None = None,
    top_valid: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
) -> LossOutput:
    """logits [B,T,V] at the positions that predicted `targets` [B,T]; advantages [B]; loss_mask [B,T]
    (bool); sampler_logp [B,T] log mu(y); kept [B,T,V] the sampler's kept set (mask replay);
    top_ids/top_logp/top_valid [B,T,K] the sampler's top-k of mu (score centering); old_logp [B,T]
    log pi_old for PPO's proximal ratio."""
    mask = loss_mask.bool()
    logp_all = processed_logprobs(logits, temperature, kept if cfg.mask_replay else None)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(mask, logp, torch.zeros_like(logp))
    with torch.no_grad():
        log_rho = torch.where(mask, logp.detach() - sampler_logp, torch.zeros_like(logp))
        rho = log_rho.exp()
        w_tok, low, high = _weight(rho, cfg)
        keep_seq = torch.ones_like(advantages, dtype=torch.bool)
        w_seq = torch.ones_like(advantages)
        if cfg.importance != "none" and cfg.importance_level == "sequence":
            seq_rho = log_rho.sum(-1).clamp(max=80).exp()
            if cfg.importance == "tis":
                w_seq = torch.clamp(seq_rho, max=cfg.sequence_cap)
            else:
                w_seq = torch.where(seq_rho <= cfg.sequence_cap, seq_rho, torch.zeros_like(seq_rho))
        if cfg.geometric_rejection:
            counts = mask.sum(-1).clamp(min=1)
            geo = (log_rho.sum(-1) / counts).exp()
            keep_seq = (geo >= cfg.geometric_low) & (geo <= cfg.geometric_high)
        weight = w_tok * w_seq[:, None] * keep_seq[:, None]
        probs = logp_all.detach().exp()
        entropy = -(probs * torch.where(probs > 0, logp_all.detach(), torch.zeros_like(probs))).sum(-1)
    adv = advantages[:, None].to(logp.dtype)
    if cfg.surrogate == "ppo":
        proximal = old_logp if old_logp is not None else logp.detach()
        ratio = (logp - proximal).exp()
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.ppo_clip, 1 + cfg.ppo_clip) * adv)
        per_token = -weight * surrogate
    else:
        per_token = -adv * weight * logp
    if cfg.score_centering:
        per_token = per_token + adv * _centering(logp_all, cfg, kept, top_ids, top_logp, top_valid, mask) * (
            w_seq[:, None] * keep_seq[:, None]
        )
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    if cfg.length_normalization:
        per_seq = per_token.sum(-1) / mask.sum(-1).clamp(min=1)
        loss = per_seq.sum() / max(int((mask.sum(-1) > 0).sum()), 1)
    else:
        loss = per_token.sum() / mask.sum().clamp(min=1)
    return LossOutput(loss, logp, rho, weight, low & mask, high & mask, entropy)


def _centering(logp_all, cfg, kept, top_ids, top_logp, top_valid, mask) -> torch.Tensor:
    """sum_v sg(c_v) log pi(v): the expected score under the sampling policy (times A, subtracted)."""
    if top_ids is None or top_logp is None:
        raise ValueError("score centering needs the sampler's top-k (ids, logprobs)")
    valid = top_valid if top_valid is not None else torch.ones_like(top_ids, dtype=torch.bool)
    logp_h = logp_all.gather(-1, top_ids)  # log pi on the sampler's top-k
    with torch.no_grad():
        mu_h = torch.where(valid, top_logp.exp(), torch.zeros_like(top_logp))
        pi_h = torch.where(valid, logp_h.detach().exp(), torch.zeros_like(top_logp))
        ratio = torch.where(valid & (mu_h > 0), pi_h / mu_h.clamp(min=1e-30), torch.zeros_like(pi_h))
        w_h, _, _ = _weight(ratio, cfg)
        coef = mu_h * w_h
        mu_tail = (1 - mu_h.sum(-1)).clamp(min=cfg.tail_eps)
        pi_tail = (1 - pi_h.sum(-1)).clamp(min=cfg.tail_eps)
        covers = mu_h.sum(-1) >= 1 - 1e-4  # the top-k holds all of mu's mass: exact, no tail term
        rho_tail = mu_tail / pi_tail
        w_tail, _, _ = _weight(1 / rho_tail, cfg)
        alpha = torch.where(covers, torch.zeros_like(rho_tail), rho_tail * w_tail)
        coef = coef - alpha[..., None] * pi_h
    safe = torch.where(valid & torch.isfinite(logp_h), logp_h, torch.zeros_like(logp_h))
    return (coef * safe).sum(-1)


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
