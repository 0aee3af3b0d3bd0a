"""The processed sampling distribution: temperature, then top-k, then top-p, exactly as samplers apply it.

Shared by the reference engine (which samples from it) and the trainer (which replays the kept set:
top-p mask replay), so both sides compute the same mask from the same rule:

- scale logits by 1/temperature (temperature 0 means greedy: the argmax alone is kept, the first
  one when several tie, as `torch.argmax` documents);
- top-k: keep every token whose scaled logit is at least the k-th largest (k <= 0: all);
- top-p: of those, sorted by descending probability, find the token at which the running sum of
  the probabilities before it reaches top_p (that crossing token is kept; at least one token always
  is), then keep every token whose probability is at least the crossing token's.

Both cuts are thresholds on values, so a token's fate depends on its value alone, never on its id
or on how a sort ordered equal values: tokens that tie are kept or dropped together. bf16 logits
tie often (8 bits of mantissa), and a cut through a tie would make the set depend on the sort, not
on the model. The mass before a token is the running sum itself (an exclusive cumsum), not
`cumsum - p`, which can round up past top_p and drop the crossing token.

`draw` samples a token from the recorded kept ids themselves, so the token the trainer replays the
mask for is always inside that mask.
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
    logits = logits.float()  # one numeric path whatever the compute dtype
    raw = torch.log_softmax(logits, dim=-1)
    if temperature <= 0:
        kept = torch.zeros_like(logits, dtype=torch.bool)
        kept.scatter_(-1, logits.argmax(dim=-1, keepdim=True), True)
        logprobs = torch.where(kept, torch.zeros_like(logits), torch.full_like(logits, float("-inf")))
        return Processed(logprobs, kept, raw)
    scaled = logits / temperature
    kept = torch.ones_like(scaled, dtype=torch.bool)
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        kept = scaled >= kth
    if top_p < 1.0:
        kept &= _top_p_keep(torch.softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1), top_p)
    logprobs = torch.log_softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)
    return Processed(logprobs, kept, raw)


def _top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Tokens whose probability is at least that of the token where the running sum crosses top_p."""
    ordered = torch.sort(probs, dim=-1, descending=True).values
    running = torch.cumsum(ordered, dim=-1)
    before = torch.cat([torch.zeros_like(running[..., :1]), running[..., :-1]], dim=-1)
    crossing = (before < top_p).sum(dim=-1, keepdim=True).clamp(min=1) - 1
    return probs >= ordered.gather(-1, crossing)


def draw(processed: Processed, row: int, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """Sample one token of `row`; returns it with the kept ids by descending probability.

    The token is drawn from those very ids (the set the trainer replays), not from a separate
    full-vocabulary distribution. Greedy processing keeps one id, which is then the token."""
    ids = torch.nonzero(processed.kept[row]).flatten()
    logprobs = processed.logprobs[row, ids]
    order = torch.argsort(logprobs, descending=True, stable=True)
    ids, logprobs = ids[order], logprobs[order]
    pick = int(torch.multinomial(logprobs.exp(), 1, generator=generator)) if len(ids) > 1 else 0
    return int(ids[pick]), ids


def truncates(temperature: float, top_k: int, top_p: float) -> bool:
    """Whether the kept set can be smaller than the vocabulary (only then is it worth recording)."""
    return temperature <= 0 or top_k > 0 or top_p < 1.0
