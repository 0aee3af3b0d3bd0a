"""The stall watchdog of `sprawl up`: when no new policy version has appeared for
`watchdog.stall_after_s`, say so loudly (live view, progress lines, the log) and name what is stuck
if the run's state can tell: the bus or S3 unreachable, a worker restarting, no trajectories (the
islands), no rewards (the reward worker), or inputs arriving but no version (the trainer).

Without it, a run whose trainer lost its feeds printed the same version for eleven minutes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pipeline.logs import get_logger
from workers.up.monitor import RunState, ServiceHealth
from workers.up.supervisor import Supervisor

log = get_logger(__name__)


@dataclass(frozen=True)
class Stall:
    seconds: float
    """Since the last new version (or since the watch began, when there has been none)."""
    head: int | None
    causes: tuple[str, ...]

    def line(self) -> str:
        head = "no version yet" if self.head is None else f"head v{self.head}"
        return f"STALLED: no new policy version for {self.seconds:.0f}s ({head}): " + "; ".join(self.causes)


class StallWatchdog:
    """Call `check` often; it returns the current stall, or None while versions keep coming."""

    def __init__(self, stall_after_s: float):
        self.stall_after_s = stall_after_s
        self.stall: Stall | None = None
        self.fired = 0
        """Stalls noticed so far (a run that moves again and stalls again counts twice)."""
        self._last: dict[str, tuple[object, float]] = {}

    def _changed_at(self, what: str, value: object, now: float) -> float:
        """When `value` last changed (the first look counts as a change)."""
        last = self._last.get(what)
        if last is None or last[0] != value:
            self._last[what] = (value, now)
            return now
        return last[1]

    def check(
        self,
        state: RunState,
        supervisor: Supervisor | None,
        bus: ServiceHealth,
        store: ServiceHealth,
        *,
        now: float | None = None,
    ) -> Stall | None:
        now = time.monotonic() if now is None else now
        version_at = self._changed_at("head", state.head, now)
        trajectories_at = self._changed_at("trajectories", sum(state.trajectories_by_view.values()), now)
        rewards_at = self._changed_at("rewards", state.rewards_seen, now)
        if now - version_at < self.stall_after_s:
            if self.stall is not None:
                log.info("run moving again", head=state.head)
            self.stall = None
            return None
        causes = self._causes(state, supervisor, bus, store, now, trajectories_at, rewards_at)
        stall = Stall(now - version_at, state.head, causes)
        if self.stall is None or self.stall.causes != causes:
            if self.stall is None:
                self.fired += 1
            log.error("run stalled", head=state.head, stalled_s=round(stall.seconds), causes=list(causes))
        self.stall = stall
        return stall

    def _causes(
        self,
        state: RunState,
        supervisor: Supervisor | None,
        bus: ServiceHealth,
        store: ServiceHealth,
        now: float,
        trajectories_at: float,
        rewards_at: float,
    ) -> tuple[str, ...]:
        causes = []
        for service in (bus, store):
            if not service.up:
                causes.append(
                    f"{service.name} is unreachable (for {time.time() - service.since:.0f}s"
                    + (f": {service.error}" if service.error else "")
                    + ")"
                )
        restarting = []
        for worker in supervisor.workers.values() if supervisor is not None else []:
            recently = worker.restarts > 0 and now - worker.started_at < self.stall_after_s
            if worker.state == "backoff" or recently:
                restarting.append(
                    f"{worker.spec.name} is restarting ({worker.restarts} restarts, last exit {worker.last_exit}"
                    + (f": {worker.last_reason}" if worker.last_reason else "")
                    + ")"
                )
        causes += restarting
        quiet = self.stall_after_s
        if now - trajectories_at >= quiet:
            islands = ", ".join(
                f"{i.island_id} {i.state}" + ("" if i.version is None else f" at v{i.version}")
                for i in sorted(state.islands.values(), key=lambda i: i.island_id)
            )
            causes.append(
                f"no trajectories for {now - trajectories_at:.0f}s: the islands generate nothing"
                + (f" ({islands})" if islands else " (no island heartbeat seen)")
            )
        elif now - rewards_at >= quiet:
            causes.append(f"no rewards for {now - rewards_at:.0f}s while trajectories arrive: the reward worker")
        elif not causes:
            causes.append("trajectories and rewards arrive but the trainer publishes no version")
        return tuple(causes)
