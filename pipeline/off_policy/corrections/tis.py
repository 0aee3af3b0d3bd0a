"""TIS: truncated importance sampling, w = min(rho, C) per token, or on the sequence ratio."""

from __future__ import annotations

import torch

from pipeline.off_policy.hooks import ImportanceWeight


class TruncatedImportance(ImportanceWeight):
    def token_weight(self, x, cfg):
        low = torch.zeros_like(x, dtype=torch.bool)
        high = torch.zeros_like(x, dtype=torch.bool)
        return torch.clamp(x, max=cfg.tis_cap), low, high

    def sequence_weight(self, seq_rho, cfg):
        return torch.clamp(seq_rho, max=cfg.sequence_cap)
