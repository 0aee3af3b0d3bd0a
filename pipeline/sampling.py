"""The processed sampling distribution: temperature, then top-k, then top-p, exactly as samplers apply it.

Shared by the reference engine (which samples from it) and the trainer (which replays the kept set:
top-p mask replay), so both sides compute the same mask from the same rule:

- scale logits by 1/temperature (temperature 0 means greedy: the argmax alone is kept);
- top-k: keep the k largest (k <= 0: all);
- top-p: of those, keep the smallest prefix by descending probability whose mass reaches top_p
  (the token that crosses the threshold is kept; at least one token always is);
- ties break by token id (stable sort), so the kept set is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Processed:
    logprobs: torch.Tensor
    """[..., vocab] log mu: renormalized over the kept set, -inf outside it (float32)."""
    kept: torch.Tensor
    """[..., vocab] bool mask of the kept set."""
    raw_logprobs: torch.Tensor
    """[..., vocab] log_softmax of the unscaled logits (the model's own distribution)."""


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> Processed:
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    vocab = logits.shape[-1]
    if temperature <= 0:
        kept = torch.zeros_like(logits, dtype=torch.bool)
        kept.scatter_(-1, logits.argmax(dim=-1, keepdim=True), True)
        logprobs = torch.where(kept, torch.zeros_like(logits), torch.full_like(logits, float("-inf")))
        return Processed(logprobs, kept, raw)
    scaled = logits / temperature
    order = torch.sort(scaled, dim=-1, descending=True, stable=True).indices
    sorted_logits = torch.gather(scaled, -1, order)
    keep_sorted = torch.ones_like(sorted_logits, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep_sorted[..., top_k:] = False
    if top_p < 1.0:
        masked = sorted_logits.masked_fill(~keep_sorted, float("-inf"))
        probs = torch.softmax(masked, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
        keep_sorted &= before < top_p
        keep_sorted[..., 0] = True
    kept = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    logprobs = torch.log_softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)
    return Processed(logprobs, kept, raw)


def truncates(temperature: float, top_k: int, top_p: float) -> bool:
    """Whether the kept set can be smaller than the vocabulary (only then is it worth recording)."""
    return temperature <= 0 or top_k > 0 or top_p < 1.0
