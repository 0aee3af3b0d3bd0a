"""When a run has collapsed, and what a cell of runs says: pure functions over per-update metrics.

A run is the `TrainerMetrics` of its updates in version order. The rule is the one the stability
experiment states in its output (`CollapseRule.describe`), so a reader of the table knows exactly what
"collapsed" counted.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import Field

from pipeline.config import Section

SERIES = (
    "reward_mean",
    "kl_k3",
    "ess_ratio",
    "masked_low",
    "masked_high",
    "format_error_rate",
    "truncation_rate",
    "entropy",
    "grad_norm",
    "loss",
)
"""The trainer metrics a run keeps per update (all are already in `trainer_metrics.v1`)."""


class CollapseRule(Section):
    """A run has collapsed at the first of `consecutive` updates in a row whose mean reward is more
    than `reward_drop` below the run's start (and, when `format_error_rate` is set, whose format-error
    rate is at least that); or at the first update whose loss or gradient norm is not finite.

    Why reward alone by default: on the demo task a policy that falls apart still writes digits (the
    pilot runs had a format-error rate of 0 while the reward halved), so requiring format errors would
    never fire at this scale; the rate is recorded per update all the same."""

    start_updates: int = Field(3, ge=1)
    """The start reward is the mean over the first this many updates."""
    reward_drop: float = Field(0.15, ge=0)
    """How far below the start reward an update must be (absolute: rewards are in [0, 1]). One update's
    mean reward over 8 groups of 16 has a spread of about 0.1, so 0.15 for 5 updates in a row is not noise."""
    format_error_rate: float | None = Field(None, ge=0, le=1)
    """When set, an update also needs at least this fraction of malformed answers to count."""
    consecutive: int = Field(5, ge=1)
    """For this many updates in a row (one noisy update is not a collapse)."""
    final_updates: int = Field(5, ge=1)
    """The final reward is the mean over the last this many updates."""

    def describe(self) -> str:
        formats = f" and format_error_rate >= {self.format_error_rate:g}" if self.format_error_rate is not None else ""
        return (
            f"collapsed at the first of {self.consecutive} consecutive updates with reward_mean < start - "
            f"{self.reward_drop:g} (start: mean of the first {self.start_updates} updates){formats}, "
            "or at the first update with a non-finite loss or grad norm"
        )


@dataclass(frozen=True)
class RunOutcome:
    updates: int
    collapsed: bool
    updates_to_collapse: int | None
    """1-based index of the update where the collapse starts."""
    start_reward: float
    final_reward: float
    kl_mean: float
    updates_without_tokens: int = 0
    """Updates where no token was left in the loss (the trainer then writes no KL, ESS or entropy and
    its gradient is 0): a run made of them did not train, so "stable" would say nothing about it."""


def _finite(value: float) -> bool:
    return math.isfinite(value) and value != -1.0  # the trainer writes -1 for a non-finite grad norm


def _finite_mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def judge(series: Mapping[str, Sequence[float]], rule: CollapseRule) -> RunOutcome:
    """Apply `rule` to one run's per-update series (each key of `SERIES`, one value per update; NaN
    where an update had no value, e.g. no KL when every token left the loss).

    An update without a reward (NaN) is no evidence either way: it neither extends nor breaks a streak,
    and the start and final rewards are means over the updates that have one."""
    rewards = list(series.get("reward_mean", []))
    if not rewards:
        raise ValueError("a run without updates cannot be judged")
    n = len(rewards)
    for name, values in series.items():
        if len(values) != n:  # a short series would be read past its end, or misaligned with the rewards
            raise ValueError(f"a run's {name} has {len(values)} values for its {n} updates")
    errors = list(series.get("format_error_rate", [0.0] * n))
    losses = list(series.get("loss", [0.0] * n))
    grads = list(series.get("grad_norm", [0.0] * n))
    start = _finite_mean(rewards[: rule.start_updates])
    if math.isnan(start):
        raise ValueError(f"a run whose first {rule.start_updates} updates have no reward has no start to fall from")
    collapse_at: int | None = None
    streak = 0
    for i in range(n):
        if not (math.isfinite(losses[i]) and _finite(grads[i])):
            collapse_at = i + 1
            break
        if math.isnan(rewards[i]):
            continue
        malformed = rule.format_error_rate is None or errors[i] >= rule.format_error_rate
        if rewards[i] < start - rule.reward_drop and malformed:
            streak += 1
            if streak == rule.consecutive:
                collapse_at = i + 1  # provisional: dated to the streak's first update below
                break
        else:
            streak = 0
    if collapse_at is not None and streak == rule.consecutive:
        low = [j for j in range(collapse_at) if not math.isnan(rewards[j])][-rule.consecutive]
        collapse_at = low + 1
    kl = list(series.get("kl_k3", [math.nan] * n))
    return RunOutcome(
        updates=n,
        collapsed=collapse_at is not None,
        updates_to_collapse=collapse_at,
        start_reward=start,
        final_reward=_finite_mean(rewards[-rule.final_updates :]),
        kl_mean=_finite_mean(kl),
        updates_without_tokens=sum(1 for v in kl if math.isnan(v)) if "kl_k3" in series else 0,
    )


@dataclass(frozen=True)
class CellSummary:
    fleet: str
    correction: str
    seeds: int
    collapsed: int
    updates_to_collapse: float | None
    """Mean over the seeds that collapsed; None when none did."""
    final_reward_mean: float
    final_reward_sd: float
    kl_mean: float

    def row(self) -> dict[str, object]:
        return {
            "fleet": self.fleet,
            "correction": self.correction,
            "seeds": self.seeds,
            "collapsed": self.collapsed,
            "updates_to_collapse": self.updates_to_collapse,
            "final_reward_mean": self.final_reward_mean,
            "final_reward_sd": self.final_reward_sd,
            "kl_mean": self.kl_mean,
        }


def summarize_cell(fleet: str, correction: str, outcomes: Sequence[RunOutcome]) -> CellSummary:
    """Mean and spread over a cell's seeds (sample sd; 0 with one seed); a seed without a final reward
    or a KL (NaN) is left out of that mean, not allowed to turn it into NaN."""
    if not outcomes:
        raise ValueError(f"cell {fleet}/{correction} has no runs")
    finals = [o.final_reward for o in outcomes if math.isfinite(o.final_reward)]
    collapse_points = [o.updates_to_collapse for o in outcomes if o.updates_to_collapse is not None]
    kls = [o.kl_mean for o in outcomes if math.isfinite(o.kl_mean)]
    return CellSummary(
        fleet=fleet,
        correction=correction,
        seeds=len(outcomes),
        collapsed=sum(o.collapsed for o in outcomes),
        updates_to_collapse=statistics.fmean(collapse_points) if collapse_points else None,
        final_reward_mean=statistics.fmean(finals) if finals else math.nan,
        final_reward_sd=statistics.stdev(finals) if len(finals) > 1 else 0.0,
        kl_mean=statistics.fmean(kls) if kls else math.nan,
    )
