"""MIS (IcePop): masked importance sampling, w = rho * 1[lo <= rho <= hi] per token, or the sequence
ratio while it stays at most C."""

from __future__ import annotations

import torch

from pipeline.off_policy.hooks import ImportanceWeight


class MaskedImportance(ImportanceWeight):
    def token_weight(self, x, cfg):
        low, high = x < cfg.mis_low, x > cfg.mis_high
        return torch.where(low | high, torch.zeros_like(x), x), low, high

    def sequence_weight(self, seq_rho, cfg):
        return torch.where(seq_rho <= cfg.sequence_cap, seq_rho, torch.zeros_like(seq_rho))
