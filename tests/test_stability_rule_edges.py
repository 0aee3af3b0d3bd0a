"""Edge cases of the stability experiment's collapse rule, cell summaries and plot, as real runs produce
them: updates where every token left the loss (no KL/ESS/entropy, gradient 0), missing rewards, series
of unequal length, seeds without a final reward, and KL stored as 0.0 by the archive."""

from __future__ import annotations

import math

import numpy as np
import pytest

from workers.experiment.collapse import SERIES, CollapseRule, judge, summarize_cell
from workers.experiment.plots import RunCurves, stability_figure
from workers.experiment.stability import series_of

NAN = math.nan


class _Metrics:
    """What `series_of` reads of a `TrainerMetrics`: its `metrics` dict."""

    def __init__(self, **metrics: float):
        self.metrics = metrics


def _update(reward: float, *, tokens: bool = True) -> _Metrics:
    """One update as the trainer writes it; without tokens in the loss it writes no KL, ESS, masked
    fractions or entropy, a loss of 0 and a gradient norm of 0 (`workers/trainer/update.py:_metrics`)."""
    base = {"reward_mean": reward, "format_error_rate": 0.0, "truncation_rate": 0.0, "loss": 0.0, "grad_norm": 0.0}
    if tokens:
        base |= {"kl_k3": 0.01, "ess_ratio": 0.9, "masked_low": 0.0, "masked_high": 0.0, "entropy": 1.0}
        base["loss"], base["grad_norm"] = 0.1, 0.5
    return _Metrics(**base)


def test_updates_without_tokens_in_the_loss_are_not_a_collapse_and_are_counted():
    metrics = [_update(0.6)] * 3 + [_update(0.6, tokens=False)] * 6 + [_update(0.6)] * 3
    series = series_of(metrics)
    assert set(series) == set(SERIES) and all(len(v) == 12 for v in series.values())
    assert math.isnan(series["kl_k3"][4]) and math.isnan(series["entropy"][4]) and series["grad_norm"][4] == 0.0
    outcome = judge(series, CollapseRule())
    assert not outcome.collapsed and outcome.updates_to_collapse is None
    assert outcome.kl_mean == pytest.approx(0.01)  # the updates without a KL are left out, not read as 0
    assert outcome.updates_without_tokens == 6


def test_a_run_that_never_had_a_token_in_the_loss_is_seen_as_not_trained():
    outcome = judge(series_of([_update(0.5, tokens=False)] * 8), CollapseRule())
    assert not outcome.collapsed and math.isnan(outcome.kl_mean) and outcome.updates_without_tokens == 8


def test_series_shorter_than_the_rewards_are_refused_not_read_past_their_end():
    with pytest.raises(ValueError, match="loss has 3 values for its 6 updates"):
        judge({"reward_mean": [0.5] * 6, "loss": [0.1] * 3}, CollapseRule())
    with pytest.raises(ValueError, match="kl_k3 has 7 values"):
        judge({"reward_mean": [0.5] * 6, "kl_k3": [0.1] * 7}, CollapseRule())


def test_a_missing_reward_neither_breaks_nor_extends_a_low_streak():
    rule = CollapseRule(start_updates=2, consecutive=3, reward_drop=0.1)
    outcome = judge({"reward_mean": [0.6, 0.6, 0.2, NAN, 0.2, 0.2, 0.6]}, rule)
    assert outcome.collapsed and outcome.updates_to_collapse == 3
    held = judge({"reward_mean": [0.6, 0.6, 0.2, NAN, 0.2, 0.6, 0.2]}, rule)
    assert not held.collapsed


def test_a_missing_start_or_final_reward_does_not_turn_the_figures_into_nan():
    rule = CollapseRule(start_updates=3, final_updates=2)
    outcome = judge({"reward_mean": [NAN, 0.4, 0.6, 0.5, 0.7, NAN]}, rule)
    assert outcome.start_reward == pytest.approx(0.5) and outcome.final_reward == pytest.approx(0.7)
    with pytest.raises(ValueError, match="no start"):
        judge({"reward_mean": [NAN, NAN, NAN, 0.5]}, rule)


def test_a_cell_leaves_out_a_seed_without_a_final_reward_or_kl():
    rule = CollapseRule(start_updates=1, final_updates=1)
    good = judge({"reward_mean": [0.5, 0.7], "kl_k3": [0.01, 0.03]}, rule)
    other = judge({"reward_mean": [0.5, 0.5], "kl_k3": [0.01, 0.01]}, rule)
    blind = judge({"reward_mean": [0.5, NAN], "kl_k3": [NAN, NAN]}, rule)
    cell = summarize_cell("mixed", "sc+mis", [good, other, blind])
    assert cell.seeds == 3 and cell.collapsed == 0
    assert cell.final_reward_mean == pytest.approx(0.6) and cell.final_reward_sd == pytest.approx(math.sqrt(0.02))
    assert cell.kl_mean == pytest.approx(0.015)


def test_the_kl_plot_treats_an_archived_zero_as_missing():
    """The archive stores an update without a KL as 0.0: on the log axis it is a gap, and it must not
    pull the mean over seeds down (one seed 0.0, the other 1e-2: the mean is 1e-2, not 5e-3)."""
    runs = [
        RunCurves("mixed", "none", 0, {"reward_mean": [0.5, 0.5], "kl_k3": [1e-2, 0.0]}),
        RunCurves("mixed", "none", 1, {"reward_mean": [0.5, 0.5], "kl_k3": [1e-2, 1e-2]}),
    ]
    fig = stability_figure(runs, ["none"])
    kl_axis = next(ax for ax in fig.axes if ax.get_title().endswith("kl_k3"))
    [line] = kl_axis.get_lines()
    assert np.allclose(line.get_ydata(), [1e-2, 1e-2])
