"""One fault (or the bad events) on a fresh run, measured end to end.

A fault run: the fleet starts and trains to `WARM_VERSION` (the loop is flowing); the log is read
(what it holds now was acknowledged to its producers); the fault is injected; the run is watched
until a version is appended after the fault ended (the recovery) or `guard_s` passes; then the fleet
stops (workers drain), the archive is drained, and the invariants are judged from the log, the
archive, the lineage blobs and the islands' files.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from pipeline.errors import SprawlError
from pipeline.logs import get_logger
from workers.bench.faults.bad_events import BadEventOutcome, effects, forge_all, publish, watch
from workers.bench.faults.faults import Fault
from workers.bench.faults.fleet import LOG_TROUBLE, Fleet, FleetShape
from workers.bench.faults.invariants import (
    Findings,
    islands_serving,
    judge_log_and_archive,
    loop_recovery_seconds,
    recovery_seconds,
)
from workers.bench.faults.ledger import positions, read_lineages, scan_archive, scan_with_retries, versions_in

log = get_logger(__name__)

WARM_VERSION = 2
"""The run is flowing (prompts -> samples -> rewards -> an update -> a version, twice) before a fault."""
RECOVERY_GOAL_S = 60.0


class RunNeverWarmed(SprawlError):
    """The run did not reach `WARM_VERSION` before any fault: nothing can be measured."""


@dataclass
class FaultResult:
    fault: str
    lost: int
    duplicated: int
    recovery_s: float | None
    """Fault end -> the next version appended; None: no version was appended while the run was watched."""
    details: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "fault": self.fault,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "recovery_s": self.recovery_s,
            "loop_recovery_s": self.details.get("loop_recovery_s"),
            "details": self.details,
        }

    @property
    def meets_goals(self) -> bool:
        islands_ok = not self.details.get("islands_not_serving_log_bits")
        loop_s = self.details.get("loop_recovery_s")
        return (
            loop_s is not None
            and loop_s <= RECOVERY_GOAL_S
            and self.lost == 0
            and self.duplicated == 0
            and self.recovery_s is not None
            and self.recovery_s <= RECOVERY_GOAL_S
            and islands_ok
        )


def new_run_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def _head_after_fault(fleet: Fleet, guard_s: float) -> int:
    """The chain's head once the log answers again."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + guard_s
    while (head := await fleet.head_version()) is None:
        if loop.time() > deadline:
            raise RunNeverWarmed(f"the log of {fleet.run_id} did not answer for {guard_s:.0f}s after the fault")
        await asyncio.sleep(0.5)
    return head


async def _trajectory_mark(fleet: Fleet, guard_s: float) -> int:
    """The TRAJECTORIES stream's last sequence, once the log answers: what was sampled before now."""
    from pipeline.topology import TRAJECTORIES

    loop = asyncio.get_running_loop()
    deadline = loop.time() + guard_s
    while True:
        try:
            return (await fleet.event_log.js.stream_info(TRAJECTORIES.name)).state.last_seq
        except LOG_TROUBLE:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _wait_for_loop(fleet: Fleet, trajectory_mark: int, guard_s: float) -> bool:
    """Until a version is trained on a trajectory sampled after `trajectory_mark`; False when `guard_s`
    passed first (the loop stalled)."""
    from pipeline.blobstore import open_blob_store
    from pipeline.topology import POLICY
    from workers.bench.faults.ledger import scan_stream

    blobs = open_blob_store(fleet.settings.blobs)
    checked: set[int] = set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + guard_s
    while loop.time() < deadline:
        fleet.check_workers_alive()
        try:
            policy = await scan_stream(fleet.event_log, POLICY, fleet.run_id)
        except LOG_TROUBLE:
            policy = []
        fresh = [v for v, _ in versions_in({"policy": policy}) if v.version not in checked]
        lineages, _ = await asyncio.to_thread(read_lineages, blobs, fresh)
        for version, lineage in lineages.items():
            checked.add(version)
            if any(m.trajectory_seq > trajectory_mark for g in lineage.groups for m in g.members):
                return True
        await asyncio.sleep(1.0)
    return False


async def _wait_for_islands(fleet: Fleet, fault_end: datetime | None, guard_s: float) -> float | None:
    """Seconds from the fault's end until every island serves a version again (None: not within
    `guard_s`; the judgement then names the island that does not)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + guard_s
    while loop.time() < deadline:
        fleet.check_workers_alive()
        try:
            islands = await islands_serving(fleet.event_log, fleet.run_id, fleet.island_dirs())
        except LOG_TROUBLE:
            islands = []
        if islands and all(i.version is not None for i in islands):
            if fault_end is None:
                return 0.0
            return round(max(0.0, (datetime.now(fault_end.tzinfo) - fault_end).total_seconds()), 2)
        await asyncio.sleep(0.5)
    return None


async def _settle_and_judge(
    fleet: Fleet,
    *,
    seen_before: set,
    guard_s: float,
    fault_end: datetime | None,
    trajectory_mark: int | None = None,
) -> tuple[Findings, float | None]:
    """Stop the fleet, drain the archive, and judge the invariants."""
    from workers.archiver import drain_once

    await fleet.stop_feed()
    await fleet.stop_workers()
    findings = Findings()
    try:
        drained = await asyncio.wait_for(drain_once(fleet.settings_of("archiver")), timeout=guard_s)
        findings.details["archive_drain_events"] = drained
    except TimeoutError:
        findings.details["archive_drain_failed"] = f"the archive did not drain within {guard_s:.0f}s"
    except Exception as exc:
        findings.details["archive_drain_failed"] = repr(exc)[:500]
    scan = await scan_with_retries(fleet.event_log, fleet.run_id, guard_s)
    archive = await asyncio.to_thread(scan_archive, fleet.settings, fleet.run_id)
    from pipeline.blobstore import open_blob_store

    lineages, unreadable = await asyncio.to_thread(
        read_lineages, open_blob_store(fleet.settings.blobs), [v for v, _ in versions_in(scan)]
    )
    acked = {(stream_label(a.stream), a.seq) for a in fleet.feed.acked}
    judged = judge_log_and_archive(
        seen_before=seen_before,
        acked=acked,
        scan=scan,
        archive=archive,
        lineages=lineages,
        lineage_unreadable=unreadable,
    )
    findings.lost, findings.duplicated = judged.lost, judged.duplicated
    findings.details |= judged.details
    islands = await islands_serving(fleet.event_log, fleet.run_id, fleet.island_dirs())
    wrong = [f"{i.island_id}: v{i.version} {i.detail}" for i in islands if not i.root_hash_ok]
    if wrong:
        findings.details["islands_not_serving_log_bits"] = wrong
    findings.details["islands_serving"] = {i.island_id: i.version for i in islands}
    findings.details["versions"] = len({v.version for v, _ in versions_in(scan)})
    findings.details["worker_events"] = fleet.supervisor_events()[-10:]
    recovery = recovery_seconds(scan, fault_end) if fault_end is not None else None
    if fault_end is not None and trajectory_mark is not None:
        findings.details["loop_recovery_s"] = loop_recovery_seconds(scan, lineages, fault_end, trajectory_mark)
    return findings, recovery


def stream_label(name: str) -> str:
    return name.lower()


async def run_fault(
    fault: Fault,
    workdir: Path,
    *,
    shape: FleetShape,
    guard_s: float,
    start_timeout_s: float = 180.0,
    model_root: Path | None = None,
) -> FaultResult:
    """`fault` on a fresh run in `workdir/<fault>`: its figures and what broke."""
    fleet = Fleet(workdir / fault.name, shape, run_id=new_run_id("fx"), model_root=model_root)
    try:
        await fleet.start(start_timeout_s)
        if not await fleet.wait_for_version(WARM_VERSION, guard_s):
            raise RunNeverWarmed(
                f"{fleet.run_id} did not reach v{WARM_VERSION} within {guard_s:.0f}s before {fault.name}",
                hint=f"worker logs: {fleet.run_dir / 'logs'}; {fleet.supervisor_events()[-5:]}",
            )
        seen_before = positions(await scan_with_retries(fleet.event_log, fleet.run_id, guard_s))
        log.info("injecting fault", fault=fault.name, run_id=fleet.run_id)
        fault_end = await fault.inject(fleet)
        head = await _head_after_fault(fleet, guard_s)
        mark = await _trajectory_mark(fleet, guard_s)
        recovered = await fleet.wait_for_version(head + 1, guard_s) and await _wait_for_loop(fleet, mark, guard_s)
        # Every island serves again before judging: a restarted island still loading its model is not yet
        # evidence of anything, and the loop can go round on the other islands alone.
        islands_back_s = await _wait_for_islands(fleet, fault_end, guard_s)
        findings, recovery = await _settle_and_judge(
            fleet, seen_before=seen_before, guard_s=guard_s, fault_end=fault_end, trajectory_mark=mark
        )
        if not recovered:
            findings.details["stalled"] = (
                f"no version trained on trajectories sampled after the fault within {guard_s:.0f}s (head was v{head})"
            )
        findings.details["islands_back_s"] = islands_back_s
        findings.details["run_id"] = fleet.run_id
        return FaultResult(fault.name, findings.lost, findings.duplicated, recovery, findings.details)
    finally:
        await fleet.close()


@dataclass
class BadEventsResult:
    outcomes: list[BadEventOutcome]
    findings: Findings


async def run_bad_events(
    workdir: Path,
    *,
    shape: FleetShape,
    guard_s: float,
    start_timeout_s: float = 180.0,
    model_root: Path | None = None,
) -> BadEventsResult:
    """Every bad-event class on a fresh, running fleet; the ones that need no sampler once the samplers
    are stopped. Then the same invariants as after a fault."""
    from pipeline.eventlog import claims_prefix
    from pipeline.topology import POLICY, TRAJECTORIES
    from schemas import PolicyVersion, Trajectory
    from workers.bench.faults.ledger import scan_stream

    fleet = Fleet(workdir / "bad_events", shape, run_id=new_run_id("bx"), model_root=model_root)
    try:
        await fleet.start(start_timeout_s)
        if not await fleet.wait_for_version(1, guard_s):
            raise RunNeverWarmed(f"{fleet.run_id} did not reach v1 within {guard_s:.0f}s")
        trajectories = [
            m for m in await scan_stream(fleet.event_log, TRAJECTORIES, fleet.run_id) if isinstance(m.event, Trajectory)
        ]
        v1 = next(
            m.event
            for m in await scan_stream(fleet.event_log, POLICY, fleet.run_id)
            if isinstance(m.event, PolicyVersion) and m.event.version == 1
        )
        seen_before = positions(await scan_with_retries(fleet.event_log, fleet.run_id, guard_s))
        claims = fleet.event_log.blobs.uri(claims_prefix(fleet.run_id, "traj"))
        forged = forge_all(fleet.run_id, trajectories[0].event, trajectories[0], v1, claims)
        published = [await publish(fleet.event_log, f) for f in forged if not f.needs_no_sampler]
        outcomes = await watch(fleet.event_log, published, guard_s)
        await asyncio.to_thread(fleet.supervisor.stop, fleet.worker_names("sampler"))
        later = [await publish(fleet.event_log, f) for f in forged if f.needs_no_sampler]
        outcomes += await watch(fleet.event_log, later, guard_s)
        await effects(fleet.event_log, fleet.run_id, published + later, outcomes)
        # Versions and their bytes after the bad events, judged like after a fault (no recovery to time).
        findings, _ = await _settle_and_judge(fleet, seen_before=seen_before, guard_s=guard_s, fault_end=None)
        findings.details["run_id"] = fleet.run_id
        return BadEventsResult(outcomes, findings)
    finally:
        await fleet.close()
