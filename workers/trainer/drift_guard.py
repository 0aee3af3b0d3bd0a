"""The per-island drift guard: notice an island that is broken, not merely different.

A mixed fleet is different by design: an mxfp4 island's sampler-trainer KL is several times a bf16
island's. What must stand out is an island far off the fleet, e.g. one that dequantizes its weights
wrongly. So each island is compared with the fleet, not with a fixed number:

- per island, the last `window` updates' token counts, k3 KL and ESS ratio are kept; the island's
  KL over the window is the token-weighted median of its per-update KLs. Not the pooled mean: k3 is
  heavy-tailed (one rare token the trainer likes 30x more than the sampler did adds ~26 / tokens to
  an update's mean), and on the demo a healthy mxfp4 island's single updates spike 40x above its
  median while a broken island is off in every update. The pooled mean is reported beside it;
- an island's baseline is the median of that KL over the OTHER islands with at least `min_tokens`
  tokens in their window (a minority of broken islands cannot move a median, and an island never
  props up its own baseline: in a fleet of bf16 + fp8 + mxfp4 + one broken island the median of all
  four would be half an mxfp4 island's KL, the median of the other three is the fp8 island's),
  floored at `floor_kl_k3` so that a fleet whose KL is ~0 does not flag noise; with fewer than
  `min_islands` judged islands (itself included) there is no meaningful median (of two, each is the
  other's whole baseline) and the floor alone is the baseline;
- an island above `factor` x baseline is flagged; a flagged one recovers below `recover_factor` x
  baseline (hysteresis); an island without `min_tokens` in its window keeps its verdict.

The verdict is on KL; the ESS ratio is reported beside it (a low ESS follows a high KL, and it is what
the corrections pay). Pure Python, no torch: the trainer feeds it the per-island metrics of each update.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

from workers.trainer.settings import DriftSection


@dataclass(frozen=True)
class IslandUpdate:
    """One update's measurement of one island."""

    tokens: float
    kl_k3: float
    ess_ratio: float


@dataclass(frozen=True)
class IslandState:
    """An island as the guard sees it after an update."""

    island_id: str
    view: str
    tokens: float
    """Tokens in its window."""
    kl_k3: float
    """Token-weighted median of its per-update k3 KL over the window: what it is judged on."""
    kl_k3_mean: float
    """Token-weighted mean of its k3 KL over the window (every token's k3, pooled)."""
    ess_ratio: float
    """Token-weighted ESS ratio over its window."""
    flagged: bool


@dataclass(frozen=True)
class DriftChange:
    """A verdict that changed with an update (what becomes an `IslandDrift` event)."""

    island_id: str
    view: str
    state: Literal["flagged", "recovered"]
    version: int
    kl_k3: float
    ess_ratio: float
    baseline_kl_k3: float
    factor: float
    quarantined: bool


class DriftGuard:
    def __init__(self, cfg: DriftSection):
        self.cfg = cfg
        self._windows: dict[str, deque[tuple[int, IslandUpdate]]] = {}
        self._views: dict[str, str] = {}
        self._flagged: set[str] = set()
        self._baselines: dict[str, float] = {}
        """Per judged island, the baseline it was judged against in the latest update."""
        self._updates = 0
        self.baseline_kl_k3 = cfg.floor_kl_k3
        """The fleet's baseline after the latest update: the median over all judged islands, floored
        (what the live view shows; each island is judged against the median of the others)."""

    @property
    def flagged(self) -> frozenset[str]:
        return frozenset(self._flagged)

    @property
    def quarantined(self) -> frozenset[str]:
        """Islands whose trajectories the next update leaves out of the loss."""
        return frozenset(self._flagged) if self.cfg.enabled and self.cfg.quarantine else frozenset()

    def observe(
        self, version: int, per_island: dict[str, dict[str, float]], views: dict[str, str] | None = None
    ) -> list[DriftChange]:
        """Take one update's per-island metrics (`tokens`, `kl_k3`, `ess_ratio`; the keys of
        `UpdateMetrics.per_island`) and return the verdicts it changed, in island order."""
        if not self.cfg.enabled:
            return []
        self._updates += 1
        for island, metrics in per_island.items():
            tokens = float(metrics.get("tokens", 0.0))
            if tokens <= 0:
                continue
            window = self._windows.setdefault(island, deque())
            window.append((self._updates, IslandUpdate(tokens, metrics["kl_k3"], metrics["ess_ratio"])))
            if views and island in views:
                self._views[island] = views[island]
        for window in self._windows.values():
            while window and window[0][0] <= self._updates - self.cfg.window:
                window.popleft()
        states = self.states()
        judged = {island: s for island, s in states.items() if s.tokens >= self.cfg.min_tokens}
        kls = {island: s.kl_k3 for island, s in judged.items()}
        self.baseline_kl_k3 = self._baseline(list(kls.values()), len(kls))
        self._baselines = {}
        changes = []
        for island, s in sorted(judged.items()):
            baseline = self._baseline([kl for other, kl in kls.items() if other != island], len(kls))
            self._baselines[island] = baseline
            if island not in self._flagged and s.kl_k3 > self.cfg.factor * baseline:
                self._flagged.add(island)
                changes.append(self._change(s, "flagged", version, baseline))
            elif island in self._flagged and s.kl_k3 < self.cfg.recover_factor * baseline:
                self._flagged.discard(island)
                changes.append(self._change(s, "recovered", version, baseline))
        return changes

    def _baseline(self, kls: list[float], judged: int) -> float:
        """The median of `kls`, floored; the floor alone when fewer than `min_islands` are judged."""
        if judged < self.cfg.min_islands or not kls:
            return self.cfg.floor_kl_k3
        return max(statistics.median(kls), self.cfg.floor_kl_k3)

    def _change(
        self, s: IslandState, state: Literal["flagged", "recovered"], version: int, baseline: float
    ) -> DriftChange:
        return DriftChange(
            island_id=s.island_id,
            view=s.view,
            state=state,
            version=version,
            kl_k3=s.kl_k3,
            ess_ratio=min(max(s.ess_ratio, 0.0), 1.0),
            baseline_kl_k3=baseline,
            factor=self.cfg.factor,
            quarantined=state == "flagged" and self.cfg.quarantine,
        )

    def states(self) -> dict[str, IslandState]:
        """Every island with tokens in its window, pooled over it."""
        out = {}
        for island, window in self._windows.items():
            tokens = sum(u.tokens for _, u in window)
            if tokens <= 0:
                continue
            out[island] = IslandState(
                island_id=island,
                view=self._views.get(island, ""),
                tokens=tokens,
                kl_k3=weighted_median([(u.kl_k3, u.tokens) for _, u in window]),
                kl_k3_mean=sum(u.tokens * u.kl_k3 for _, u in window) / tokens,
                ess_ratio=sum(u.tokens * u.ess_ratio for _, u in window) / tokens,
                flagged=island in self._flagged,
            )
        return out

    def restore_flagged(self, islands: frozenset[str]) -> None:
        """Start flagged on `islands` (a restarted trainer: the quarantined set of the chain's head)."""
        self._flagged = set(islands)

    def report(self) -> dict[str, dict[str, float]]:
        """Per island, the guard's view for the metrics event: windowed KL/ESS/tokens and the verdict."""
        return {
            island: {
                "window_kl_k3": s.kl_k3,
                "window_kl_k3_mean": s.kl_k3_mean,
                "window_ess_ratio": s.ess_ratio,
                "window_tokens": s.tokens,
                "flagged": float(s.flagged),
                **({"baseline_kl_k3": self._baselines[island]} if island in self._baselines else {}),
            }
            for island, s in self.states().items()
        }


def weighted_median(values: list[tuple[float, float]]) -> float:
    """The weighted median of (value, weight) pairs (weights > 0): the value at which the cumulative
    weight passes half the total; where it lands exactly on half, the midpoint of the values on either
    side (the plain median of equal weights)."""
    ordered = sorted(values)
    half = sum(w for _, w in ordered) / 2
    running = 0.0
    for i, (value, weight) in enumerate(ordered):
        running += weight
        if running > half:
            return value
        if running == half and i + 1 < len(ordered):
            return (value + ordered[i + 1][0]) / 2
    return ordered[-1][0]
