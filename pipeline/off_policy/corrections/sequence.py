"""Sequence-level importance: the product of a sequence's token ratios, exp(sum_t log rho_t)."""

from __future__ import annotations

from pipeline.off_policy.hooks import SequenceLevel

MAX_LOG_RATIO = 80
"""exp(80) is about 5.5e34: finite in float32, far above any cap."""


class SequenceRatio(SequenceLevel):
    def ratio(self, log_rho):
        return log_rho.sum(-1).clamp(max=MAX_LOG_RATIO).exp()
