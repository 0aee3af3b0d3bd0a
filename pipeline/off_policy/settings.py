"""The corrected loss's settings (no torch here: workers validate them before importing it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from pipeline.config import Section


class LossSection(Section):
    """The off-policy corrected surrogate (formulas: OFF_POLICY.md). The switches are what a
    `--correction` spec sets (`pipeline.off_policy.registry`); the numbers are their parameters."""

    surrogate: Literal["pg", "ppo"] = "pg"
    """`pg` (policy gradient) or `ppo` (clipped)."""
    importance: Literal["none", "tis", "mis"] = "mis"
    """Importance weights between trainer (pi) and sampler (mu): `none`, `tis` (truncated) or `mis` (masked)."""
    importance_level: Literal["token", "sequence"] = Field("token", validate_default=True)
    """Where `tis`/`mis` apply: per `token`, or once per `sequence` (the product of its token ratios)."""
    geometric_rejection: bool = False
    """Drop sequences whose geometric-mean ratio leaves [geometric_low, geometric_high]."""
    score_centering: bool = True
    """Subtract the expected score under the sampling policy (top-k form)."""
    mask_replay: bool = True
    """Renormalize the trainer's distribution over the sampler's kept top-p set."""
    length_normalization: bool = False
    """True: every sequence weighs the same (mean over its tokens); False: every token weighs the same."""
    ppo_clip: float = Field(0.2, gt=0, lt=1)
    """PPO: the ratio to the proximal policy is clipped to [1 - ppo_clip, 1 + ppo_clip]."""
    tis_cap: float = Field(2.0, gt=0)
    """TIS (token): w = min(rho, tis_cap)."""
    mis_low: float = Field(0.5, ge=0)
    """MIS (token): tokens with rho below this leave the loss."""
    mis_high: float = Field(5.0, gt=0, validate_default=True)
    """MIS (token): tokens with rho above this leave the loss."""
    sequence_cap: float = Field(2.0, gt=0)
    """Sequence level: TIS caps the sequence ratio here; MIS drops sequences whose ratio exceeds it."""
    geometric_low: float = Field(0.5, ge=0)
    """Geometric rejection: lower bound on exp(mean log rho)."""
    geometric_high: float = Field(2.0, gt=0, validate_default=True)
    """Geometric rejection: upper bound on exp(mean log rho)."""
    tail_eps: float = Field(1e-6, gt=0, le=1e-2)
    """Score centering: floor of the probability mass outside the top-k (keeps the tail ratio finite)."""

    @field_validator("importance_level")
    @classmethod
    def _level_needs_a_weight(cls, value: str, info: ValidationInfo) -> str:
        if value == "sequence" and info.data.get("importance") == "none":
            raise ValueError("'sequence' needs importance 'tis' or 'mis' (it is 'none')")
        return value

    @field_validator("mis_high", "geometric_high")
    @classmethod
    def _above_low(cls, value: float, info: ValidationInfo) -> float:
        low_name = info.field_name.replace("_high", "_low")  # type: ignore[union-attr]
        low = info.data.get(low_name)
        if low is not None and value <= low:
            raise ValueError(f"must be above {low_name} ({low}), is {value}")
        return value
