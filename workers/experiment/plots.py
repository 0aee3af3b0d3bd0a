"""The stability experiment's figure: reward and KL over updates, one panel per fleet, one line per
correction (the mean over seeds, the band from the lowest to the highest seed).

Shared by the committed PNGs under `experiments/stability/` and the section of `sprawl report`, so
the two always draw the same thing from the same numbers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure

CURVES = {"reward_mean": "reward (mean over the update)", "kl_k3": "KL(sampler || trainer), k3"}
"""Which per-update series get a row of panels, with their axis labels."""
LOG_SCALED = {"kl_k3"}
"""Curves drawn on a log axis (where values <= 0 are gaps)."""


@dataclass(frozen=True)
class RunCurves:
    fleet: str
    correction: str
    seed: int
    series: Mapping[str, Sequence[float]]


def stability_figure(runs: Iterable[RunCurves], corrections: Sequence[str]) -> Figure:
    """Rows: the CURVES; columns: the fleets in the order first seen."""
    cells: dict[tuple[str, str], list[RunCurves]] = defaultdict(list)
    fleets: list[str] = []
    for run in runs:
        cells[(run.fleet, run.correction)].append(run)
        if run.fleet not in fleets:
            fleets.append(run.fleet)
    fig = Figure(figsize=(6.0 * max(1, len(fleets)), 3.6 * len(CURVES)), layout="constrained")
    axes = fig.subplots(len(CURVES), max(1, len(fleets)), squeeze=False, sharex=True)
    colors = {c: f"C{i}" for i, c in enumerate(corrections)}
    for col, fleet in enumerate(fleets):
        for row, (metric, label) in enumerate(CURVES.items()):
            ax = axes[row][col]
            for correction in corrections:
                seeds = [r.series.get(metric, []) for r in cells.get((fleet, correction), [])]
                seeds = [s for s in seeds if len(s)]
                if not seeds:
                    continue
                length = min(len(s) for s in seeds)
                stacked = np.array([list(s)[:length] for s in seeds], dtype=float)
                if metric in LOG_SCALED:
                    # A log axis cannot show 0, and a 0 here is no measurement: the archived results store
                    # an update without a KL (no token left in the loss) as 0.0. Missing, not a low value.
                    stacked[stacked <= 0] = np.nan
                x = np.arange(1, length + 1)
                ax.plot(x, np.nanmean(stacked, axis=0), color=colors[correction], linewidth=1.6, label=correction)
                if len(seeds) > 1:
                    low, high = np.nanmin(stacked, axis=0), np.nanmax(stacked, axis=0)
                    ax.fill_between(x, low, high, color=colors[correction], alpha=0.15, linewidth=0)
            if metric in LOG_SCALED:
                ax.set_yscale("log")
            ax.set_title(f"{fleet} fleet: {metric}")
            ax.set_ylabel(label)
            if row == len(CURVES) - 1:
                ax.set_xlabel("update (policy version)")
            if row == 0 and col == 0:
                ax.legend(title="correction (mean; band: min-max over seeds)", fontsize="small", loc="best")
    return fig
