"""The stages of the loss core where a correction plugs in: one base class per stage.

A correction's module under `corrections/` defines a subclass of one of these; the loss core
(`pipeline.off_policy.loss`) calls every active correction's hook at its stage. Shapes: B sequences,
T output positions, V vocabulary, K top-k entries. Everything but the score terms' and surrogates'
results is computed without gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.off_policy.settings import LossSection

TokenWeight = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""x -> (w(x), masked low, masked high): the token-level importance weight in force (ones without one)."""


class Hook:
    """Base of every stage."""


class Support(Hook):
    """Which vocabulary the trainer's distribution is normalized over."""

    def kept(self, kept: torch.Tensor | None) -> torch.Tensor | None:
        """[B,T,V] bool of the ids to keep (None: the whole vocabulary)."""
        raise NotImplementedError


class ImportanceWeight(Hook):
    """Weights pi/mu; at most one is in force (`LossSection.importance`)."""

    def token_weight(self, x: torch.Tensor, cfg: LossSection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w(x) per token, with the masks of what it dropped below / above its range."""
        raise NotImplementedError

    def sequence_weight(self, seq_rho: torch.Tensor, cfg: LossSection) -> torch.Tensor:
        """[B] the weight of whole sequences from their ratio."""
        raise NotImplementedError


class SequenceLevel(Hook):
    """Moves the importance weight from tokens to whole sequences."""

    def ratio(self, log_rho: torch.Tensor) -> torch.Tensor:
        """[B,T] log pi/mu (0 off the loss mask) -> [B] the sequence ratio."""
        raise NotImplementedError


class SequenceFilter(Hook):
    """Keeps or rejects whole sequences."""

    def keep(self, log_rho: torch.Tensor, mask: torch.Tensor, cfg: LossSection) -> torch.Tensor:
        """[B] bool: the sequences that stay in the loss."""
        raise NotImplementedError


class Surrogate(Hook):
    """The per-token surrogate the weights multiply."""

    def per_token(
        self,
        logp: torch.Tensor,
        adv: torch.Tensor,
        weight: torch.Tensor,
        cfg: LossSection,
        old_logp: torch.Tensor | None,
    ) -> torch.Tensor:
        """[B,T] loss per token from log pi(y) (with grad), A [B,1], the weight [B,T]."""
        raise NotImplementedError


class ScoreTerm(Hook):
    """A term added per token, times A and the sequence weights (score centering)."""

    def per_token(
        self,
        logp_all: torch.Tensor,
        cfg: LossSection,
        top_ids: torch.Tensor | None,
        top_logp: torch.Tensor | None,
        top_valid: torch.Tensor | None,
        token_weight: TokenWeight,
    ) -> torch.Tensor:
        """[B,T] the term (with grad through `logp_all`)."""
        raise NotImplementedError
