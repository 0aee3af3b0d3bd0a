"""PPO-clip surrogate: min(r A, clip(r, 1-eps, 1+eps) A) with r = pi / pi_old (pi_old = sg(pi) when not given)."""

from __future__ import annotations

import torch

from pipeline.off_policy.hooks import Surrogate


class PPOClip(Surrogate):
    def per_token(self, logp, adv, weight, cfg, old_logp):
        proximal = old_logp if old_logp is not None else logp.detach()
        ratio = (logp - proximal).exp()
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.ppo_clip, 1 + cfg.ppo_clip) * adv)
        return -weight * surrogate
