"""Geometric rejection: keep a sequence iff lo <= exp(mean_t log rho_t) <= hi."""

from __future__ import annotations

from pipeline.off_policy.hooks import SequenceFilter


class GeometricRejection(SequenceFilter):
    def keep(self, log_rho, mask, cfg):
        counts = mask.sum(-1).clamp(min=1)
        geo = (log_rho.sum(-1) / counts).exp()
        return (geo >= cfg.geometric_low) & (geo <= cfg.geometric_high)
