"""The per-island drift guard: notice an island that is broken, not merely different.

A mixed fleet is different by design: an mxfp4 island's sampler-trainer KL is several times a bf16
island's. What must stand out is an island far off the fleet, e.g. one that dequantizes its weights
wrongly. So each island is compared with the fleet, not with a fixed number:

- per island, the last `window` updates' token counts, token-weighted k3 KL and ESS ratio are pooled;
- the baseline is the median of the pooled KL over islands with at least `min_tokens` tokens in their
  window (a minority of broken islands cannot move a median), floored at `floor_kl_k3` so that a fleet
  whose KL is ~0 does not flag noise; with fewer than `min_islands` such islands there is no meaningful
  median (of two, one broken island drags it to half its own KL) and the floor alone is the baseline;
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
    """Token-weighted k3 KL over its window."""
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
        self._updates = 0
        self.baseline_kl_k3 = cfg.floor_kl_k3
        """The baseline of the latest update."""

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
        self.baseline_kl_k3 = self._baseline([s.kl_k3 for s in judged.values()])
        changes = []
        for island, s in sorted(judged.items()):
            if island not in self._flagged and s.kl_k3 > self.cfg.factor * self.baseline_kl_k3:
                self._flagged.add(island)
                changes.append(self._change(s, "flagged", version))
            elif island in self._flagged and s.kl_k3 < self.cfg.recover_factor * self.baseline_kl_k3:
                self._flagged.discard(island)
                changes.append(self._change(s, "recovered", version))
        return changes

    def _baseline(self, kls: list[float]) -> float:
        if len(kls) < self.cfg.min_islands:
            return self.cfg.floor_kl_k3
        return max(statistics.median(kls), self.cfg.floor_kl_k3)

    def _change(self, s: IslandState, state: Literal["flagged", "recovered"], version: int) -> DriftChange:
        return DriftChange(
            island_id=s.island_id,
            view=s.view,
            state=state,
            version=version,
            kl_k3=s.kl_k3,
            ess_ratio=min(max(s.ess_ratio, 0.0), 1.0),
            baseline_kl_k3=self.baseline_kl_k3,
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
                kl_k3=sum(u.tokens * u.kl_k3 for _, u in window) / tokens,
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
                "window_ess_ratio": s.ess_ratio,
                "window_tokens": s.tokens,
                "flagged": float(s.flagged),
            }
            for island, s in self.states().items()
        }
