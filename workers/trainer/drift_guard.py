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
  baseline (hysteresis); an island without `min_tokens` in its window keeps its verdict; with
  `ceiling_kl_k3` set, above it is flagged too (a broken majority lifts the median, not the ceiling);
- island ids are self-declared in trajectories, so an island can stay below `min_tokens` forever by
  taking a fresh id every few trajectories. Each update's tokens of islands that are not judged go
  into one pseudo-island, `UNJUDGED` ("unjudged-islands"), judged like an island against the median
  of all judged islands once at least one real island is judged (at a fleet's start every island is
  unjudged: that is no evidence). Flagged, it is an `IslandDrift` like any other, and with quarantine
  the rows of every island not yet judged leave the loss until the pool recovers (a healthy newcomer
  waits until it has `min_tokens`; it is measured meanwhile);
- a KL that is not a number (NaN, missing with tokens) is taken as infinite: an island whose numbers
  cannot be measured is broken, and one NaN must not blind the guard (every comparison with NaN is
  false). What the guard reports is finite (the log refuses NaN and inf).

The verdict is on KL; the ESS ratio is reported beside it (a low ESS follows a high KL, and it is what
the corrections pay). Pure Python, no torch: the trainer feeds it the per-island metrics of each update.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import deque
from dataclasses import dataclass
from typing import Literal

from schemas import IslandDrift
from workers.trainer.settings import DriftSection

UNJUDGED = "unjudged-islands"
"""The pseudo-island of each update's tokens from islands that are not judged (fewer than `min_tokens` in
their window). A real island that calls itself this is pooled with them."""
_SQUATTER = "\x00" + UNJUDGED
"""Where a real island named `UNJUDGED` keeps its window: not a token, so no island can take it."""


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

    def event(self, run_id: str) -> IslandDrift:
        """The `island_drift.v1` event that says so."""
        return IslandDrift(
            run_id=run_id,
            island_id=self.island_id,
            view=self.view,
            state=self.state,
            version=self.version,
            kl_k3=self.kl_k3,
            ess_ratio=self.ess_ratio,
            baseline_kl_k3=self.baseline_kl_k3,
            factor=self.factor,
            quarantined=self.quarantined,
        )


class DriftGuard:
    def __init__(self, cfg: DriftSection):
        self.cfg = cfg
        self._windows: dict[str, deque[tuple[int, IslandUpdate]]] = {}
        self._views: dict[str, str] = {}
        self._flagged: set[str] = set()
        self._baselines: dict[str, float] = {}
        """Per judged island, the baseline it was judged against in the latest update."""
        self._judged: frozenset[str] = frozenset()
        """Islands with `min_tokens` in their window after the latest update."""
        self._updates = 0
        self.unjudged_tokens = 0.0
        """Tokens of the latest update from islands that were not judged (what went into `UNJUDGED`)."""
        self.update_tokens = 0.0
        """Tokens of the latest update, all islands."""
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
        now: dict[str, IslandUpdate] = {}
        for island, metrics in per_island.items():
            tokens = _finite_or(metrics.get("tokens", 0.0), 0.0)
            if tokens <= 0:
                continue
            # Not measurable is broken: NaN (or a missing KL) becomes +inf, which sorts and compares.
            kl = max(_finite_or(metrics.get("kl_k3", math.nan), math.inf), 0.0)
            ess = min(max(_finite_or(metrics.get("ess_ratio"), 0.0), 0.0), 1.0)
            key = _SQUATTER if island == UNJUDGED else island  # never judged by itself: always in the pool
            now[key] = IslandUpdate(tokens, kl, ess)
            self._windows.setdefault(key, deque()).append((self._updates, now[key]))
            if views and island in views:
                self._views[key] = views[island]
        for island in list(self._windows):
            window = self._windows[island]
            while window and window[0][0] <= self._updates - self.cfg.window:
                window.popleft()
            if not window:
                # Silent for a whole window: forget its numbers (a verdict stays in `_flagged`), so an
                # island that takes a fresh id every few trajectories cannot grow the guard without end.
                del self._windows[island]
                self._views.pop(island, None)
        states = self._island_states()
        judged = {island: s for island, s in states.items() if s.tokens >= self.cfg.min_tokens}
        self._judged = frozenset(judged)
        self.unjudged_tokens = sum(u.tokens for island, u in now.items() if island not in judged)
        self.update_tokens = sum(u.tokens for u in now.values())
        kls = {island: s.kl_k3 for island, s in judged.items()}
        self.baseline_kl_k3 = self._baseline(list(kls.values()), len(kls))
        self._baselines = {}
        changes = []
        for island, s in sorted(judged.items()):
            baseline = self._baseline([kl for other, kl in kls.items() if other != island], len(kls))
            changes += self._verdict(s, version, baseline)
        pool = self._pool_state()
        if pool is not None and pool.tokens >= self.cfg.min_tokens and judged:
            changes += self._verdict(pool, version, self.baseline_kl_k3)
        return changes

    def _verdict(self, s: IslandState, version: int, baseline: float) -> list[DriftChange]:
        self._baselines[s.island_id] = baseline
        flag_line, recover_line = self.cfg.factor * baseline, self.cfg.recover_factor * baseline
        if self.cfg.ceiling_kl_k3 is not None:  # a broken majority cannot lift this line
            flag_line = min(flag_line, self.cfg.ceiling_kl_k3)
            recover_line = min(recover_line, self.cfg.ceiling_kl_k3 * self.cfg.recover_factor / self.cfg.factor)
        if s.island_id not in self._flagged and s.kl_k3 > flag_line:
            self._flagged.add(s.island_id)
            return [self._change(s, "flagged", version, baseline)]
        if s.island_id in self._flagged and s.kl_k3 < recover_line:
            self._flagged.discard(s.island_id)
            return [self._change(s, "recovered", version, baseline)]
        return []

    def quarantine_for(self, islands: set[str] | frozenset[str]) -> frozenset[str]:
        """The islands the next update leaves out of the loss, given the ids in its batch: the flagged
        ones, and while the unjudged pool is flagged, every id of the batch that is not judged (and the
        pool's own id, so that the set recorded in the lineage says why). Concrete ids: recovery replays
        exactly this set from the lineage."""
        out = set(self.quarantined)
        if UNJUDGED in out:
            out |= {island for island in islands if island not in self._judged}
        return frozenset(out)

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
            kl_k3=finite(s.kl_k3),
            ess_ratio=min(max(s.ess_ratio, 0.0), 1.0),
            baseline_kl_k3=finite(baseline),
            factor=self.cfg.factor,
            quarantined=state == "flagged" and self.cfg.quarantine,
        )

    def states(self) -> dict[str, IslandState]:
        """Every island with tokens in its window, pooled over it; and `UNJUDGED`, the islands that are
        not judged (under `min_tokens`) pooled update by update, when they have tokens."""
        out = self._island_states()
        pool = self._pool_state()
        if pool is not None:
            out[UNJUDGED] = pool
        return out

    def _island_states(self) -> dict[str, IslandState]:
        return {
            island: self._state(island, [u for _, u in window])
            for island, window in self._windows.items()
            if island != _SQUATTER
        }

    def _pool_state(self) -> IslandState | None:
        """The windows of the islands that are not judged now, one pooled measurement per update: an
        island leaves the pool with all its updates once it has `min_tokens` (at a fleet's start every
        island is in it; a broken one's early updates must not keep the pool flagged once it is judged
        by its own id)."""
        by_update: dict[int, list[IslandUpdate]] = {}
        for island, window in self._windows.items():
            if island in self._judged:
                continue
            for n, u in window:
                by_update.setdefault(n, []).append(u)
        if not by_update:
            return None
        return self._state(UNJUDGED, [_pool(updates) for _, updates in sorted(by_update.items())])

    def _state(self, island: str, updates: list[IslandUpdate]) -> IslandState:
        tokens = sum(u.tokens for u in updates)
        return IslandState(
            island_id=island,
            view=self._views.get(island, ""),
            tokens=tokens,
            kl_k3=weighted_median([(u.kl_k3, u.tokens) for u in updates]),
            kl_k3_mean=sum(u.tokens * u.kl_k3 for u in updates) / tokens,
            ess_ratio=sum(u.tokens * u.ess_ratio for u in updates) / tokens,
            flagged=island in self._flagged,
        )

    def restore_flagged(self, islands: frozenset[str]) -> None:
        """Start flagged on `islands` (a restarted trainer: the quarantined set of the chain's head)."""
        self._flagged = set(islands)

    def report(self) -> dict[str, dict[str, float]]:
        """Per island, the guard's view for the metrics event: windowed KL/ESS/tokens and the verdict."""
        return {
            island: {
                "window_kl_k3": finite(s.kl_k3),
                "window_kl_k3_mean": finite(s.kl_k3_mean),
                "window_ess_ratio": s.ess_ratio,
                "window_tokens": s.tokens,
                "flagged": float(s.flagged),
                **({"baseline_kl_k3": finite(self._baselines[island])} if island in self._baselines else {}),
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


def finite(value: float) -> float:
    """`value` with +inf as the largest float: the log's JSON has no inf (it would be written as null)."""
    return min(value, sys.float_info.max)


def _finite_or(value: float | None, otherwise: float) -> float:
    return float(value) if value is not None and math.isfinite(value) else otherwise


def _pool(updates: list[IslandUpdate]) -> IslandUpdate:
    """Several islands' measurements of one update as one: tokens summed, KL and ESS token-weighted."""
    tokens = sum(u.tokens for u in updates)
    kl = sum(u.tokens * u.kl_k3 for u in updates) / tokens  # tokens > 0: an inf KL stays inf, never NaN
    return IslandUpdate(tokens, kl, sum(u.tokens * u.ess_ratio for u in updates) / tokens)
