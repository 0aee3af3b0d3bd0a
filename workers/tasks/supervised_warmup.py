"""The short supervised warm-up that gives a tiny model from a config a policy worth training with RL.

Both task models (`sprawl up`'s arithmetic demo and a file task's character model) start from random
weights; a few hundred AdamW steps of next-token cross-entropy on the answers (the prompt is context,
not target) make the first rollouts score above zero. The models are cached by everything that shapes
them, so the loop must stay exactly what it is: its bits are part of each cache entry.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

Progress = Callable[[int, int, float], None]
"""(steps done, steps in all, the last step's loss)."""


def train_on_answers(
    model: torch.nn.Module,
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    lr: float,
    progress: Progress | None = None,
) -> None:
    """`steps` AdamW steps on `next_batch()`'s (token ids [B, T], answer mask [B, T]): the loss is the
    mean cross-entropy of the next token over the positions the mask marks."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        ids, mask = next_batch()
        logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        loss = (loss * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if progress is not None:
            progress(step + 1, steps, loss.item())


def move_into_cache(staging: Path, directory: Path, complete_marker: str) -> Path:
    """Rename a fully written `staging` directory to `directory` (atomic: a half-written cache entry is
    never used). When another process built the same entry first, its copy is used and ours dropped."""
    try:
        staging.rename(directory)
    except OSError:
        if not (directory / complete_marker).exists():
            raise
        shutil.rmtree(staging)
    return directory
