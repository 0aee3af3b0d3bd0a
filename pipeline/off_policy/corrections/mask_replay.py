"""Top-p mask replay: the trainer renormalizes over the set the sampler kept (logits outside it -inf)."""

from __future__ import annotations

from pipeline.off_policy.hooks import Support


class MaskReplay(Support):
    def kept(self, kept):
        return kept
