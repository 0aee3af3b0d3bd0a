"""Score centering (SC), top-k form: subtract the expected score under the sampling policy.

corr = sum_{h in top-k} sg(mu_h w(pi_h/mu_h) - alpha pi_h) log pi_h, alpha = rho_tail w(1/rho_tail),
and no tail term when the top-k holds all of mu's mass (then SC is exact). See OFF_POLICY.md.
"""

from __future__ import annotations

import torch

from pipeline.off_policy.hooks import ScoreTerm


class ScoreCentering(ScoreTerm):
    def per_token(self, logp_all, cfg, top_ids, top_logp, top_valid, token_weight):
        if top_ids is None or top_logp is None:
            raise ValueError("score centering needs the sampler's top-k (ids, logprobs)")
        valid = top_valid if top_valid is not None else torch.ones_like(top_ids, dtype=torch.bool)
        logp_h = logp_all.gather(-1, top_ids)  # log pi on the sampler's top-k
        with torch.no_grad():
            mu_h = torch.where(valid, top_logp.exp(), torch.zeros_like(top_logp))
            pi_h = torch.where(valid, logp_h.detach().exp(), torch.zeros_like(top_logp))
            ratio = torch.where(valid & (mu_h > 0), pi_h / mu_h.clamp(min=1e-30), torch.zeros_like(pi_h))
            w_h, _, _ = token_weight(ratio)
            coef = mu_h * w_h
            mu_tail = (1 - mu_h.sum(-1)).clamp(min=cfg.tail_eps)
            pi_tail = (1 - pi_h.sum(-1)).clamp(min=cfg.tail_eps)
            covers = mu_h.sum(-1) >= 1 - 1e-4  # the top-k holds all of mu's mass: exact, no tail term
            rho_tail = mu_tail / pi_tail
            w_tail, _, _ = token_weight(1 / rho_tail)
            alpha = torch.where(covers, torch.zeros_like(rho_tail), rho_tail * w_tail)
            coef = coef - alpha[..., None] * pi_h
        safe = torch.where(valid & torch.isfinite(logp_h), logp_h, torch.zeros_like(logp_h))
        return (coef * safe).sum(-1)
