"""`sprawl experiment stability`: which off-policy corrections keep a mixed-precision fleet from collapsing.

Each (fleet, correction, seed) is one real `sprawl up` run on the demo task and model: its own run id,
the whole fleet as processes against the local stack, the stress below, and nothing in-process faked.
After a run, its `trainer_metrics.v1` events are read back from the log, the collapse rule is applied
(`workers/experiment/collapse.py`), and one `stability_result.v1` event is appended under the
experiment's own run id: `sprawl sql --run-id <experiment>` and `sprawl report --run-id <experiment>`
read the whole table from the archive, and each cell's run keeps its own metrics, versions and
trajectories. A rerun with the same `--experiment-id` skips the runs it already recorded, so an
interrupted matrix continues where it stopped.

The stress (`[stress]`, defaults stated in `StressSection`) is what an asynchronous fleet has beyond
precision: the prompt driver runs several versions ahead (staleness), and the islands sample at a
temperature and top-p other than the trainer's.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import CliPositionalArg

from pipeline.config import ChainSettings, CommandOptions, Section, write_settings_file
from pipeline.errors import SprawlError
from pipeline.logs import get_logger
from pipeline.off_policy.registry import apply_spec
from schemas import StabilityResult, TrainerMetrics
from workers.experiment.collapse import SERIES, CellSummary, CollapseRule, RunOutcome, judge, summarize_cell
from workers.trainer.settings import TrainerSection
from workers.up.options import PromptSection, TaskSettings, UpSettings, WatchdogSection

if TYPE_CHECKING:
    from pipeline.eventlog import EventLog

log = get_logger(__name__)
T = TypeVar("T")
E = TypeVar("E")
K = TypeVar("K")

FLEETS: dict[str, tuple[str, ...]] = {
    "homogeneous": ("bf16", "bf16", "bf16"),
    "mixed": ("bf16", "fp8_e4m3", "mxfp4"),
}
"""The islands of each fleet, one view each: the same number of islands, so only precision differs."""
CORRECTIONS = ("none", "tis", "mis", "sc", "sc+mis", "sc+mis+mask")
"""The matrix's corrections (`--correction` specs), from plain GRPO to the seed report's recipe."""
BASELINE = ("homogeneous", "sc+mis")
"""The cell every other is compared with."""
QUICK_CELLS = (("homogeneous", "sc+mis"), ("mixed", "none"))
"""`--quick`: the baseline and the cell the seed report says collapses, one seed each."""
FULL_UPDATES, QUICK_UPDATES = 30, 15


class StressSection(Section):
    """What an asynchronous fleet has besides precision. The defaults are the levels the committed
    results under experiments/stability/ were run with."""

    sample_temperature: float = Field(0.8, gt=0)
    """Islands sample at this temperature..."""
    train_temperature: float = Field(1.0, gt=0)
    """...and the trainer computes its logprobs at this one (a mismatch when they differ)."""
    top_p: float = Field(0.9, gt=0, le=1)
    """Islands' nucleus threshold; the trainer's distribution is the full one unless mask replay is on."""
    groups_ahead: int = Field(32, ge=1)
    """Prompt groups the driver keeps published beyond what the trainer has taken: with 8 groups per
    update the fleet runs about 4 versions ahead (plus the islands' own lag behind the chain's head)."""
    max_staleness: int = Field(8, ge=0)
    """Tokens staler than this many versions leave the loss (the trainer's bound)."""

    def as_record(self) -> dict[str, float]:
        return {name: float(value) for name, value in self.model_dump().items()}


class StabilitySettings(UpSettings):
    """The experiment's settings: a `sprawl up` run's (stack, trainer, task), the stress and the rule."""

    stress: StressSection = StressSection()
    """The stress every run of the matrix has."""
    collapse: CollapseRule = CollapseRule()
    """When a run counts as collapsed."""


class ExperimentOptions(CommandOptions):
    """How this `sprawl experiment` runs."""

    name: CliPositionalArg[Literal["stability"]]
    """The experiment: `stability` (corrections x fleets under stress, several seeds)."""
    quick: bool = False
    """2 cells (homogeneous sc+mis, mixed none) x 1 seed x 15 updates: a few minutes."""
    seeds: int | None = Field(None, ge=1)
    """Seeds per cell (default 3; 1 with --quick)."""
    updates: int | None = Field(None, ge=1)
    """Updates per run (default 30; 15 with --quick)."""
    fleets: list[str] | None = None
    """Only these fleets (homogeneous, mixed)."""
    corrections: list[str] | None = None
    """Only these corrections (none, tis, mis, sc, sc+mis, sc+mis+mask)."""
    experiment_id: str | None = None
    """Name of the experiment (its runs are `<id>-<fleet>-<correction>-s<seed>`); the same id again
    continues it, skipping runs already recorded. Default: `stab-<UTC time>`."""
    output: Path = Path("experiments/stability")
    """Where table.csv, runs.csv, series.csv and stability.png are written."""
    json_output: bool = Field(False, validation_alias="json")
    """Print the result as one JSON object, last on stdout."""

    @field_validator("fleets", "corrections", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value

    @field_validator("fleets")
    @classmethod
    def _known_fleets(cls, value: list[str] | None) -> list[str] | None:
        for fleet in value or []:
            if fleet not in FLEETS:
                raise ValueError(f"unknown fleet {fleet!r}: choose from {', '.join(FLEETS)}")
        return value

    @field_validator("corrections")
    @classmethod
    def _valid_corrections(cls, value: list[str] | None) -> list[str] | None:
        for spec in value or []:
            apply_spec(TrainerSection().loss, spec)  # unknown or conflicting names fail here, not mid-matrix
        return value


@dataclass(frozen=True)
class PlannedRun:
    fleet: str
    correction: str
    seed: int

    def run_id(self, experiment_id: str, attempt: int = 1) -> str:
        """The run of this cell's seed; a later attempt (after a crash) gets a run of its own, because a
        run id that has a chain would be continued, not started again."""
        base = f"{experiment_id}-{self.fleet}-{self.correction.replace('+', '_')}-s{self.seed}"
        return base if attempt == 1 else f"{base}-a{attempt}"


def plan(options: ExperimentOptions) -> list[PlannedRun]:
    """Every run of the matrix, seed-major so that a cut-short matrix still covers every cell once."""
    if options.quick and not (options.fleets or options.corrections):
        cells = list(QUICK_CELLS)
    else:
        fleets = options.fleets or list(FLEETS)
        corrections = options.corrections or list(CORRECTIONS)
        cells = [(f, c) for f in fleets for c in corrections]
    seeds = options.seeds or (1 if options.quick else 3)
    return [PlannedRun(f, c, s) for s in range(seeds) for f, c in cells]


def updates_per_run(options: ExperimentOptions) -> int:
    return options.updates or (QUICK_UPDATES if options.quick else FULL_UPDATES)


# ---------------------------------------------------------------- one run


class RunFailed(SprawlError):
    """A run of the matrix ended without finishing its updates (a crash, a stop): not a collapse."""


def up_command(settings: StabilitySettings, run: PlannedRun, run_id: str, updates: int, config: Path) -> list[str]:
    """The `sprawl up` invocation of one run (flags win over the config file and the environment)."""
    views = FLEETS[run.fleet]
    stress = settings.stress
    command = [sys.executable, "-m", "workers.cli", "up", "--fresh", "--run-id", run_id]
    command += ["--state-dir", str(settings.state_dir.resolve())]
    command += ["--config", str(config)]
    command += ["--versions", str(updates), "--islands", str(len(views)), "--views", ",".join(views)]
    command += ["--correction", run.correction, "--no-live", "--json"]
    command += ["--trainer.seed", str(run.seed), "--trainer.max-staleness", str(stress.max_staleness)]
    command += ["--trainer.train-temperature", repr(stress.train_temperature)]
    command += ["--prompts.temperature", repr(stress.sample_temperature), "--prompts.top-p", repr(stress.top_p)]
    command += ["--prompts.groups-ahead", str(stress.groups_ahead)]
    return command


def run_up(command: list[str], log_file: Path) -> dict:
    """Run one `sprawl up` to its end; its summary (the last stdout line). Its stderr goes to `log_file`."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("w") as err:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=err, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    summary: dict = {}
    if lines:
        try:
            summary = json.loads(lines[-1])
        except json.JSONDecodeError:
            summary = {}
    if done.returncode != 0 or summary.get("interrupted"):
        raise RunFailed(
            f"`sprawl up` exited {done.returncode}" + (" (interrupted)" if summary.get("interrupted") else ""),
            hint=f"its output is in {log_file}; rerun the experiment with the same --experiment-id to continue",
        )
    return summary


async def _with_log(settings: StabilitySettings, work: Callable[[EventLog], Awaitable[T]]) -> T:
    """`work` on a connection of its own (the experiment talks to the log between runs of minutes: a
    connection held across them would only wait out outages nobody is reading)."""
    from pipeline.eventlog import EventLog

    event_log = await EventLog.connect(settings, worker="experiment")
    try:
        return await work(event_log)
    finally:
        await event_log.close()


async def _newest_by(
    event_log: EventLog, run_id: str, qualifier: str, kind: type[E], key: Callable[[E], K]
) -> dict[K, E]:
    """The `kind` events on the run's `metrics.<qualifier>` subject, the newest per `key` (a retried
    append or a rerun records the same key again)."""
    from pipeline.replay import replay
    from pipeline.topology import METRICS, Kind, run_subject, token

    found: dict[K, E] = {}
    async for item in replay(event_log, METRICS.name, run_subject(token(run_id, "run_id"), Kind.METRICS, qualifier)):
        if isinstance(item.event, kind):
            found[key(item.event)] = item.event
    return found


async def _trainer_metrics(event_log: EventLog, run_id: str) -> list[TrainerMetrics]:
    by_version = await _newest_by(event_log, run_id, "trainer", TrainerMetrics, lambda m: m.version)
    return [by_version[v] for v in sorted(by_version)]


async def _recorded(event_log: EventLog, experiment_id: str) -> dict[tuple[str, str, int], StabilityResult]:
    return await _newest_by(
        event_log, experiment_id, "stability", StabilityResult, lambda r: (r.fleet, r.correction, r.seed)
    )


async def _fresh_run_id(event_log: EventLog, run: PlannedRun, experiment_id: str) -> str:
    """The first attempt's run id whose chain is empty (an earlier attempt crashed part way)."""
    from pipeline.version_log import chain_head

    for attempt in range(1, 100):
        run_id = run.run_id(experiment_id, attempt)
        if await chain_head(event_log, run_id) is None:
            return run_id
    raise RunFailed(
        f"{run.fleet}/{run.correction}/seed {run.seed} failed 99 times", hint="see the runs' logs; start anew"
    )


def check_versions(metrics: Sequence, updates: int, run_id: str) -> None:
    """A run's metrics are exactly versions 1..updates: fewer means metrics never reached the log, other
    versions mean the run was not the fresh chain the experiment asked for."""
    versions = [m.version for m in metrics]
    if versions != list(range(1, updates + 1)):
        raise RunFailed(
            f"run {run_id} has trainer metrics for versions {versions[:3]}...{versions[-3:]} "
            f"({len(versions)}), not exactly 1..{updates}",
            hint="a run that did not start from an empty chain, or metrics that did not reach the log; "
            f"see {run_id}'s logs under the state folder's runs/",
        )


def _nullable(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def series_of(metrics: Sequence) -> dict[str, list[float]]:
    """Per-update curves of the metrics the experiment keeps (NaN where an update had no value)."""
    return {name: [float(m.metrics.get(name, math.nan)) for m in metrics] for name in SERIES}


# ---------------------------------------------------------------- the record in the log


async def _declare(event_log: EventLog, settings: StabilitySettings, experiment_id: str) -> None:
    """The streams (a fresh stack has none until a run declares them) and the experiment's own
    consumers: its id is a run of its own in the log, whose results the archiver reads like any run's."""
    from infra.streams import apply

    await apply(event_log.js, settings.streams, experiment_id, log=settings.log, nats=settings.nats)


async def _archive(settings: StabilitySettings, experiment_id: str) -> int:
    """Bring the experiment's archive up to date (its results; each run's archive `up` drained)."""
    from infra import stack
    from pipeline.config import load_settings
    from workers.archiver import ArchiverSettings, drain_once

    archiver = load_settings(
        ArchiverSettings,
        None,
        run_id=experiment_id,
        state_dir=settings.state_dir,
        nats=settings.nats,
        blobs=settings.blobs,
        log=settings.log,
        streams=settings.streams,
    )
    return await drain_once(stack.with_role(archiver, "archiver"))


# ---------------------------------------------------------------- the matrix


@dataclass(frozen=True)
class Recorded:
    run: PlannedRun
    outcome: RunOutcome
    series: dict[str, list[float]]
    run_id: str = ""
    """The run it trained in (an attempt after a crash has its own)."""


class RunSections(BaseModel):
    """What every run of the matrix shares with the experiment's own settings (from its flags,
    `SPRAWL_...` variables and `--config`), handed to each `sprawl up` as its config file. The stack's
    endpoints are not: each run finds the local stack under the same state folder."""

    trainer: TrainerSection
    chain: ChainSettings
    task: TaskSettings
    prompts: PromptSection
    watchdog: WatchdogSection


def write_run_config(settings: StabilitySettings, directory: Path) -> Path:
    sections = RunSections(
        trainer=settings.trainer,
        chain=settings.chain,
        task=settings.task,
        prompts=settings.prompts,
        watchdog=settings.watchdog,
    )
    return write_settings_file(sections, directory / "up.toml")


def run_matrix(options: ExperimentOptions, settings: StabilitySettings) -> tuple[dict, list[CellSummary]]:
    from pipeline.topology import token

    experiment_id = options.experiment_id or "stab-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    token(experiment_id, "experiment_id")
    updates = updates_per_run(options)
    runs = plan(options)
    rule = settings.collapse
    logs = settings.state_dir.resolve() / "experiments" / experiment_id
    config = write_run_config(settings, logs)
    settings = _local_stack(settings)
    asyncio.run(_with_log(settings, lambda log: _declare(log, settings, experiment_id)))
    earlier = asyncio.run(_with_log(settings, lambda log: _recorded(log, experiment_id)))
    results: list[Recorded] = []
    print(
        f"experiment {experiment_id}: {len(runs)} runs of {updates} updates "
        f"({len(earlier)} already recorded); stress {settings.stress.as_record()}",
        file=sys.stderr,
    )
    mismatched = sorted({r.updates for r in earlier.values()} - {updates})
    if mismatched:
        raise SprawlError(
            f"experiment {experiment_id} has runs of {', '.join(map(str, mismatched))} updates; this one asks "
            f"for {updates}",
            hint="a table mixes runs of one length only: give a new --experiment-id (or the same --updates)",
        )
    for index, run in enumerate(runs, 1):
        label = f"[{index}/{len(runs)}] {run.fleet} / {run.correction} / seed {run.seed}"
        known = earlier.get((run.fleet, run.correction, run.seed))
        if known is not None:
            # Judged again from its stored curves: the rule of this invocation decides, not the recorded one.
            series = {k: [_nan(v) for v in vs] for k, vs in known.series.items()}
            results.append(Recorded(run, judge(series, rule), series, known.cell_run_id))
            print(f"{label}: recorded earlier", file=sys.stderr)
            continue
        run_id = asyncio.run(_with_log(settings, lambda log, run=run: _fresh_run_id(log, run, experiment_id)))
        started = time.monotonic()
        run_up(up_command(settings, run, run_id, updates, config), logs / f"{run_id}.log")
        metrics = asyncio.run(_with_log(settings, lambda log, run_id=run_id: _trainer_metrics(log, run_id)))
        check_versions(metrics, updates, run_id)
        series = series_of(metrics)
        outcome = judge(series, rule)
        result = StabilityResult(
            run_id=experiment_id,
            experiment_id=experiment_id,
            cell_run_id=run_id,
            fleet=run.fleet,
            correction=run.correction,
            seed=run.seed,
            updates=outcome.updates,
            collapsed=outcome.collapsed,
            updates_to_collapse=outcome.updates_to_collapse,
            start_reward=outcome.start_reward,
            final_reward=_nullable(outcome.final_reward),
            kl_mean=_nullable(outcome.kl_mean),
            collapse_rule=rule.describe(),
            stress=settings.stress.as_record(),
            series={k: [_nullable(v) for v in vs] for k, vs in series.items()},
        )
        asyncio.run(_with_log(settings, lambda log, result=result: log.append(result)))
        results.append(Recorded(run, outcome, series, run_id))
        print(
            f"{label}: reward {outcome.start_reward:.3f} -> {outcome.final_reward:.3f}, KL {outcome.kl_mean:.2e}, "
            f"{'collapsed at update ' + str(outcome.updates_to_collapse) if outcome.collapsed else 'stable'} "
            f"({time.monotonic() - started:.0f} s)",
            file=sys.stderr,
        )
    archived = asyncio.run(_archive(settings, experiment_id))
    log.info("experiment archived", experiment_id=experiment_id, rows=archived)
    cells = summarize(results)
    write_outputs(options.output, cells, results, settings, experiment_id)
    return result_json(experiment_id, cells, settings, updates), cells


def _local_stack(settings: StabilitySettings) -> StabilitySettings:
    """The local stack every run of the matrix uses, started now if it is not running (each `sprawl up`
    would start it too, but the experiment reads the log before the first run), and the settings as
    the stack's admin."""
    from infra import stack

    stack.up(settings)
    return stack.with_role(settings, "admin")


def summarize(results: Sequence[Recorded]) -> list[CellSummary]:
    cells: dict[tuple[str, str], list[RunOutcome]] = {}
    for r in results:
        cells.setdefault((r.run.fleet, r.run.correction), []).append(r.outcome)
    order = {c: i for i, c in enumerate(CORRECTIONS)}
    keys = sorted(cells, key=lambda k: (list(FLEETS).index(k[0]), order.get(k[1], len(order)), k[1]))
    return [summarize_cell(f, c, cells[(f, c)]) for f, c in keys]


def relative_rows(cells: Sequence[CellSummary]) -> list[dict[str, object]]:
    """Each cell's row, with its final reward and KL as ratios to the baseline cell (when it ran)."""
    baseline = next((c for c in cells if (c.fleet, c.correction) == BASELINE), None)
    rows = []
    for cell in cells:
        row = cell.row()
        if baseline is not None and baseline.final_reward_mean:
            row["final_reward_vs_baseline"] = cell.final_reward_mean / baseline.final_reward_mean
        else:
            row["final_reward_vs_baseline"] = None
        if baseline is not None and baseline.kl_mean and math.isfinite(baseline.kl_mean):
            row["kl_vs_baseline"] = cell.kl_mean / baseline.kl_mean
        else:
            row["kl_vs_baseline"] = None
        rows.append(row)
    return rows


def _json_safe(row: dict[str, object]) -> dict[str, object]:
    """NaN (no value) as null: the last line must be JSON, which has no NaN."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def result_json(experiment_id: str, cells: Sequence[CellSummary], settings: StabilitySettings, updates: int) -> dict:
    return {
        "experiment_id": experiment_id,
        "cells": [_json_safe(row) for row in relative_rows(cells)],
        "collapse_rule": settings.collapse.describe(),
        "stress": settings.stress.as_record(),
        "updates_per_run": updates,
        "baseline": {"fleet": BASELINE[0], "correction": BASELINE[1]},
        "fleets": {name: list(views) for name, views in FLEETS.items()},
    }


def _cell_text(value: object) -> object:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else value


def _csv(path: Path, rows: Sequence[dict[str, object]]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: ("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)) for k, v in row.items()}
            )


def write_outputs(
    output: Path,
    cells: Sequence[CellSummary],
    results: Sequence[Recorded],
    settings: StabilitySettings,
    experiment_id: str,
) -> None:
    """table.csv (the JSON's cells), runs.csv (one row per run), series.csv (one row per update) and
    stability.png (reward and KL over updates per cell)."""
    from workers.experiment.plots import RunCurves, stability_figure

    output.mkdir(parents=True, exist_ok=True)
    _csv(output / "table.csv", relative_rows(cells))
    _csv(
        output / "runs.csv",
        [
            {
                "experiment_id": experiment_id,
                "run_id": r.run_id or r.run.run_id(experiment_id),
                "fleet": r.run.fleet,
                "correction": r.run.correction,
                "seed": r.run.seed,
                "updates": r.outcome.updates,
                "collapsed": r.outcome.collapsed,
                "updates_to_collapse": r.outcome.updates_to_collapse,
                "start_reward": r.outcome.start_reward,
                "final_reward": r.outcome.final_reward,
                "kl_mean": r.outcome.kl_mean,
            }
            for r in results
        ],
    )
    _csv(
        output / "series.csv",
        [
            {"fleet": r.run.fleet, "correction": r.run.correction, "seed": r.run.seed, "update": i + 1}
            | {name: values[i] for name, values in r.series.items()}
            for r in results
            for i in range(r.outcome.updates)
        ],
    )
    fig = stability_figure(
        [RunCurves(r.run.fleet, r.run.correction, r.run.seed, r.series) for r in results],
        [c for c in CORRECTIONS if any(r.run.correction == c for r in results)]
        + sorted({r.run.correction for r in results} - set(CORRECTIONS)),
    )
    fig.savefig(output / "stability.png", dpi=90)
    (output / "settings.json").write_text(
        json.dumps(
            {
                "experiment_id": experiment_id,
                "stress": settings.stress.as_record(),
                "collapse_rule": settings.collapse.describe(),
                "trainer": settings.trainer.model_dump(mode="json", exclude={"model_dir", "loss"}),
                "prompts": settings.prompts.model_dump(mode="json"),
                "fleets": {name: list(views) for name, views in FLEETS.items()},
            },
            indent=2,
        )
        + "\n"
    )


def print_table(cells: Sequence[CellSummary]) -> str:
    rows = relative_rows(cells)
    head = (
        f"{'fleet':<12} {'correction':<12} {'collapsed':>9} {'to collapse':>11} "
        f"{'final reward':>15} {'KL k3':>9} {'vs base':>8}"
    )
    lines = [head]
    for row in rows:
        to_collapse = "-" if row["updates_to_collapse"] is None else f"{row['updates_to_collapse']:.0f}"
        reward = f"{row['final_reward_mean']:.3f} ± {row['final_reward_sd']:.3f}"
        rel = "-" if row["final_reward_vs_baseline"] is None else f"{row['final_reward_vs_baseline']:.2f}x"
        lines.append(
            f"{row['fleet']:<12} {row['correction']:<12} {row['collapsed']:>4}/{row['seeds']:<4} {to_collapse:>11} "
            f"{reward:>15} {row['kl_mean']:>9.2e} {rel:>8}"
        )
    return "\n".join(lines)


def cmd_experiment(options: ExperimentOptions, settings: StabilitySettings) -> int:
    result, cells = run_matrix(options, settings)
    human = sys.stderr if options.json_output else sys.stdout
    print(print_table(cells), file=human)
    print(f"collapse rule: {result['collapse_rule']}", file=human)
    print(f"written to {options.output}/", file=human)
    if options.json_output:
        print(json.dumps(result, allow_nan=False))
    return 0
