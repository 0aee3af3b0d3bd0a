"""Off-policy corrected policy-gradient losses (the formula sheet is `OFF_POLICY.md`).

- `settings.LossSection`: the loss's settings (switches and their parameters), torch-free.
- `registry`: the corrections by name (`sc`, `mis`, `tis`, `mask`, `geo`, `seq`, `ppo`), what a
  `--correction` spec means, torch-free.
- `hooks`: the stages of the loss core a correction plugs into; `corrections/`: one module each.
- `loss`: the core, `policy_loss`, plus GRPO advantages and the full-vocabulary SC reference.

Importing this package does not import torch; the loss functions load it on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.off_policy.registry import (
    CORRECTIONS,
    ConflictingCorrections,
    Correction,
    UnknownCorrection,
    apply_spec,
    correction_spec,
    loss_fields,
    register_correction,
)
from pipeline.off_policy.settings import LossSection

if TYPE_CHECKING:
    from pipeline.off_policy.loss import (
        NEG_INF,
        LossOutput,
        full_vocab_centering_loss,
        grpo_advantages,
        policy_loss,
        processed_logprobs,
    )

_LAZY = {"NEG_INF", "LossOutput", "full_vocab_centering_loss", "grpo_advantages", "policy_loss", "processed_logprobs"}

__all__ = [
    "CORRECTIONS",
    "NEG_INF",
    "ConflictingCorrections",
    "Correction",
    "LossOutput",
    "LossSection",
    "UnknownCorrection",
    "apply_spec",
    "correction_spec",
    "full_vocab_centering_loss",
    "grpo_advantages",
    "loss_fields",
    "policy_loss",
    "processed_logprobs",
    "register_correction",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from pipeline.off_policy import loss

        return getattr(loss, name)
    raise AttributeError(f"module 'pipeline.off_policy' has no attribute {name!r}")
