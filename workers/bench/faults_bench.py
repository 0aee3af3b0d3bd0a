"""`sprawl bench faults`: the fault matrix and the bad-event classes on small real runs, measured.

Each fault runs on a fresh run (its own private stack, the workers as processes); the bad events on
one more. The figures are what the harness read from the log, the archive, the lineage blobs and
the islands' files (`workers/bench/faults/`), reported as measured, goals beside them:
every `lost` and `duplicated` 0, every `recovery_s` <= 60 (and `loop_recovery_s`, to the first version
trained on samples taken after the fault), every bad event dead-lettered or refused within 30 s.
`--quick`: one island, and of the faults the worker kills and the nats-server restart.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from workers.bench.faults.bad_events import GOAL_S, GOOD_OUTCOMES
from workers.bench.faults.faults import catalogue
from workers.bench.faults.fleet import FleetShape
from workers.bench.faults.matrix import RECOVERY_GOAL_S, RunNeverWarmed, run_bad_events, run_fault

WATCH_S = 180.0
"""How long the bench watches for a recovery or a bad event's end: three times the recovery goal, six
times the bad-event goal. Past it the figure is reported as not reached (null / `pending`)."""

QUICK_FAULTS = ("sigkill_trainer", "sigkill_sampler", "sigkill_rewards", "sigkill_archiver", "nats_sigkill_restart")


async def _measure(quick: bool, workdir: Path) -> dict:
    shape = FleetShape(islands=1 if quick else 2)
    faults = [f for f in catalogue() if not quick or f.name in QUICK_FAULTS]
    models = workdir / "models"  # the base policy is warmed up once for every run
    results = []
    for fault in faults:
        try:
            result = await run_fault(fault, workdir, shape=shape, guard_s=WATCH_S, model_root=models)
            results.append(result.summary())
        except RunNeverWarmed as exc:
            results.append(
                {"fault": fault.name, "lost": None, "duplicated": None, "recovery_s": None, "error": str(exc)}
            )
    bad = await run_bad_events(workdir, shape=shape, guard_s=WATCH_S, model_root=models)
    return {
        "faults": results,
        "bad_events": [o.summary() for o in bad.outcomes],
        "bad_events_run": {"lost": bad.findings.lost, "duplicated": bad.findings.duplicated, **bad.findings.details},
        "goals": {"lost": 0, "duplicated": 0, "recovery_s_max": RECOVERY_GOAL_S, "bad_event_s_max": GOAL_S},
    }


def _row(kind: str, name: str, outcome: str, lost, duplicated, seconds, goal_met: bool) -> dict:
    return {
        "kind": kind,
        "name": name,
        "outcome": outcome,
        "lost": "-" if lost is None else lost,
        "duplicated": "-" if duplicated is None else duplicated,
        "seconds": "-" if seconds is None else float(seconds),
        "goal met": "yes" if goal_met else "NO",
    }


def bench_faults(quick: bool) -> tuple[list[dict], dict]:
    with tempfile.TemporaryDirectory(prefix="sprawl-faults-") as tmp:
        summary = asyncio.run(_measure(quick, Path(tmp)))
    rows = []
    for f in summary["faults"]:
        broke = sorted(k for k in f.get("details", {}) if k not in _INFORMATIONAL)
        met = f["lost"] == 0 and f["duplicated"] == 0 and f["recovery_s"] is not None
        loop_s = f.get("loop_recovery_s")
        met = met and f["recovery_s"] <= RECOVERY_GOAL_S and loop_s is not None and loop_s <= RECOVERY_GOAL_S
        met = met and not broke
        outcome = f.get("error") or (", ".join(broke) if broke else "ok")
        rows.append(_row("fault", f["fault"], outcome[:80], f["lost"], f["duplicated"], f["recovery_s"], met))
        rows[-1]["loop s"] = "-" if f.get("loop_recovery_s") is None else float(f["loop_recovery_s"])
    for b in summary["bad_events"]:
        met = b["outcome"] in GOOD_OUTCOMES and b["seconds"] is not None and b["seconds"] <= GOAL_S
        rows.append(_row("bad event", b["class"], b["outcome"], None, None, b["seconds"], met) | {"loop s": "-"})
    return rows, summary


_INFORMATIONAL = frozenset(
    {
        "archive_drain_events",
        "islands_serving",
        "versions",
        "worker_events",
        "run_id",
        "trajectory_ids_stored_twice",
        "loop_recovery_s",
    }
)
"""Details that describe the run rather than a broken invariant."""
