"""`sprawl up`: the stack, the whole fleet as supervised processes, a real short RL run, a summary.

Phases: stack up (or reuse) and streams declared; the base policy built and warmed up (cached);
trainer, sampler islands (a mixed-precision fleet: one view each), reward worker and archiver
started under a supervisor; a prompt driver keeps a bounded number of prompt groups ahead of the
trainer (so staleness stays small without any lockstep); the run ends when the trainer publishes
its last version. Then the workers drain, the archive is brought up to date, the HTML report is
written and the summary printed. Ctrl-C at any point stops every worker (and the stack, if this
command started it). A second `sprawl up` continues the previous run from the log; `--fresh`
starts a new one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, field_validator

from pipeline.errors import SprawlError
from pipeline.logs import get_logger
from workers.up.demo_task import VOCAB_SIZE, TaskConfig

log = get_logger(__name__)

VIEW_ALIASES = {"fp8": "fp8_e4m3", "bf16": "bf16", "fp8_e4m3": "fp8_e4m3"}
CORRECTIONS = {
    "sc": {"score_centering": True},
    "mis": {"importance": "mis"},
    "tis": {"importance": "tis"},
    "mask": {"mask_replay": True},
    "geo": {"geometric_rejection": True},
    "seq": {"importance_level": "sequence"},
    "ppo": {"surrogate": "ppo"},
}


class UpOptions(BaseModel):
    """What `sprawl up` runs. The defaults are the demo's tuned settings (see the README)."""

    quick: bool = False
    islands: int = 2
    views: list[str] = ["bf16", "fp8_e4m3"]
    correction: str = "sc+mis+mask"
    fresh: bool = False
    json_output: bool = False
    versions: int | None = None
    """Updates this invocation adds to the run (default 500, quick 30)."""
    groups_per_batch: int = 8
    group_size: int = 16
    learning_rate: float = 3e-4
    top_p: float = 0.95
    groups_ahead: int = 16
    """Prompt groups published beyond what the trainer has taken: bounds staleness at about
    groups_ahead / groups_per_batch versions."""
    keyframe_every: int = 50
    live: bool | None = None
    """Rich live view (default: when the output is a terminal)."""

    @field_validator("views", mode="before")
    @classmethod
    def _views(cls, value):
        names = value.split(",") if isinstance(value, str) else value
        out = []
        for name in (n.strip() for n in names if n.strip()):
            if name not in VIEW_ALIASES:
                raise ValueError(f"unknown view {name!r}: choose from bf16, fp8 (fp8_e4m3)")
            out.append(VIEW_ALIASES[name])
        if not out:
            raise ValueError("--views needs at least one view")
        return out

    @field_validator("correction")
    @classmethod
    def _correction(cls, value: str) -> str:
        loss_fields(value)
        return value

    @field_validator("islands")
    @classmethod
    def _islands(cls, value: int) -> int:
        if value < 1:
            raise ValueError("--islands must be at least 1")
        return value

    @property
    def target_versions(self) -> int:
        return self.versions if self.versions is not None else (30 if self.quick else 500)

    def island_views(self) -> list[str]:
        return [self.views[i % len(self.views)] for i in range(self.islands)]


def loss_fields(correction: str) -> dict[str, object]:
    """`sc+mis+mask` (any of sc, mis, tis, mask, geo, seq, ppo, or `none`) as trainer loss settings."""
    fields: dict[str, object] = {"score_centering": False, "mask_replay": False, "importance": "none"}
    for part in correction.replace(",", "+").split("+"):
        part = part.strip().lower()
        if part in ("", "none"):
            continue
        if part not in CORRECTIONS:
            raise ValueError(f"unknown correction {part!r}: combine {', '.join(CORRECTIONS)} with '+', or 'none'")
        fields |= CORRECTIONS[part]
    return fields


# ---------------------------------------------------------------- run identity


def choose_run_id(state_dir: Path, explicit: str | None, fresh: bool) -> tuple[str, bool]:
    """(run id, continuing?): the explicit one, else the previous run unless `fresh`, else a new one."""
    marker = state_dir / "current_run"
    if explicit:
        return explicit, False
    if not fresh and marker.exists() and marker.read_text().strip():
        return marker.read_text().strip(), True
    return "run-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S"), False


def remember_run(state_dir: Path, run_id: str) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "current_run").write_text(run_id + "\n")


# ---------------------------------------------------------------- worker environments


def worker_specs(
    options: UpOptions, *, base_env: dict[str, str], model_dir: Path, state_dir: Path, max_version: int
) -> list:
    from workers.up.supervisor import WorkerSpec

    sprawl = [sys.executable, "-m", "workers.cli"]
    env = {
        **base_env,
        "SPRAWL_LOG_FORMAT": "json",
        # Every worker is single-threaded: 2 cores are shared by five processes.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    loss = {f"SPRAWL_TRAINER__LOSS__{k.upper()}": str(v).lower() for k, v in loss_fields(options.correction).items()}
    specs = [
        WorkerSpec(
            "trainer",
            [*sprawl, "trainer"],
            {
                **env,
                **loss,
                "SPRAWL_TRAINER__MODEL_DIR": str(model_dir),
                "SPRAWL_TRAINER__TRAINER_ID": f"up-{socket.gethostname()}".lower(),
                "SPRAWL_TRAINER__GROUPS_PER_BATCH": str(options.groups_per_batch),
                "SPRAWL_TRAINER__GROUP_SIZE": str(options.group_size),
                "SPRAWL_TRAINER__LEARNING_RATE": str(options.learning_rate),
                "SPRAWL_TRAINER__MAX_VERSIONS": str(max_version),
                "SPRAWL_TRAINER__CHECKPOINT_EVERY": "10",
                "SPRAWL_CHAIN__VIEWS": json.dumps(sorted(set(options.views))),
                "SPRAWL_CHAIN__KEYFRAME_EVERY": str(options.keyframe_every),
            },
        )
    ]
    for index, view in enumerate(options.island_views()):
        island_id = f"island{index}-{view.split('_')[0]}"
        specs.append(
            WorkerSpec(
                f"sampler-{island_id}",
                [*sprawl, "sampler"],
                {
                    **env,
                    "SPRAWL_ISLAND__VIEW": view,
                    "SPRAWL_ISLAND__ISLAND_ID": island_id,
                    "SPRAWL_ISLAND__TOP_LOGPROBS": str(VOCAB_SIZE),
                    "SPRAWL_ISLAND__POLL_INTERVAL_S": "1",
                    # The materializer adds <run>/<view>/ below this.
                    "SPRAWL_ISLAND__MATERIALIZE__CACHE_DIR": str(state_dir / "islands" / island_id),
                    "SPRAWL_HEARTBEAT_INTERVAL_S": "2",
                },
            )
        )
    specs.append(WorkerSpec("rewards", [*sprawl, "rewards"], env))
    specs.append(WorkerSpec("archiver", [*sprawl, "archiver"], env))
    return specs


# ---------------------------------------------------------------- the run


@dataclass
class UpResult:
    run_id: str
    summary: dict
    interrupted: bool


class _Output:
    """Human output goes to stdout, or to stderr when stdout is reserved for `--json`."""

    def __init__(self, json_output: bool):
        from rich.console import Console

        self.console = Console(file=sys.stderr if json_output else sys.stdout, highlight=False)
        if not self.console.is_terminal:
            self.console.width = 200  # logs and pipes: one line per line, not wrapped at 80 columns

    def print(self, *args, **kwargs) -> None:
        self.console.print(*args, **kwargs)


def run_up(options: UpOptions, settings_cls, config: Path | None, overrides: dict) -> UpResult:
    from infra import stack
    from pipeline.config import load_settings
    from pipeline.logs import configure_logging

    out = _Output(options.json_output)
    # A closed terminal (SIGHUP) or a `kill` (SIGTERM) stops the run like Ctrl-C does: cleanly.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    base = load_settings(settings_cls, config, **overrides)
    state_dir = base.state_dir
    run_id, continuing = choose_run_id(state_dir, overrides.get("run_id"), options.fresh)
    settings = load_settings(settings_cls, config, **{**overrides, "run_id": run_id})
    # Our own logs go to a file: the terminal belongs to the live view.
    run_dir = state_dir.resolve() / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    configure_logging(run_id, "json", settings.log_level, file=run_dir / "up.log")

    started = time.monotonic()
    was_running = stack.status(settings) is not None
    try:
        st = stack.up(settings)
    except KeyboardInterrupt:
        if not was_running:
            stack.down(settings)  # Ctrl-C while the servers were starting: stop what had started
        raise
    started_stack = not st.already_running
    out.print(f"stack {'reused' if st.already_running else 'started'}: nats {st.nats_url}, s3 {st.s3_endpoint}")
    settings = settings.model_copy(
        update={
            "nats": settings.nats.model_copy(update={"url": st.nats_url}),
            "blobs": settings.blobs.model_copy(update={"endpoint_url": st.s3_endpoint})
            if hasattr(settings.blobs, "endpoint_url")
            else settings.blobs,
        }
    )
    remember_run(state_dir, run_id)
    interrupted = False
    try:
        result = asyncio.run(_run(options, settings, config, run_dir, continuing, out, started))
        interrupted = result.interrupted
        return result
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if interrupted and started_stack:
            out.print("stopping the stack: " + ", ".join(stack.down(settings)))


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _base_env(settings, config: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()}
    env |= {
        "SPRAWL_RUN_ID": settings.run_id,
        "SPRAWL_STATE_DIR": str(settings.state_dir.resolve()),
        "SPRAWL_NATS__URL": settings.nats.url,
    }
    if getattr(settings.blobs, "endpoint_url", None):
        env["SPRAWL_BLOBS__ENDPOINT_URL"] = settings.blobs.endpoint_url
    if config is not None:
        env["SPRAWL_CONFIG"] = str(config.resolve())
    # Workers import the project from where this command runs (an editable install, or a checkout).
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


async def _run(options: UpOptions, settings, config, run_dir: Path, continuing: bool, out: _Output, t0: float):
    from rich.live import Live
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from infra.streams import apply
    from pipeline.blobstore import open_blob_store
    from pipeline.eventlog import EventLog
    from pipeline.version_log import chain_head
    from workers.lifecycle import stop_on_signals
    from workers.up.demo_task import warmed_up_model
    from workers.up.live_view import progress_line, render
    from workers.up.monitor import RunMonitor
    from workers.up.prompt_driver import PromptDriver, prompts_in_log
    from workers.up.summary import summarize
    from workers.up.supervisor import Supervisor

    event_log = await EventLog.connect(settings, worker="up")
    await apply(event_log.js, settings.streams, settings.run_id)
    cfg = TaskConfig()

    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
        console=out.console, transient=False, disable=options.json_output and not out.console.is_terminal,
    ) as bar:  # fmt: skip
        task = bar.add_task("warm-up (cached after the first run)", total=cfg.warmup_steps, info="")

        def on_step(step: int, total: int, loss: float) -> None:
            bar.update(task, completed=step, info=f"loss {loss:.3f}")

        model_dir = await asyncio.to_thread(warmed_up_model, settings.state_dir, cfg, on_step)
        bar.update(task, completed=cfg.warmup_steps)
    out.print(f"base policy: {model_dir}")

    head = await chain_head(event_log, settings.run_id)
    start_version = head.version if head is not None else 0
    target = start_version + options.target_versions
    out.print(
        f"run {settings.run_id}: "
        + (f"continuing from v{start_version}" if continuing and head is not None else "new run")
        + f", training to v{target} ({options.islands} islands: {', '.join(options.island_views())};"
        f" correction {options.correction})"
    )

    blobs = open_blob_store(settings.blobs)
    monitor = RunMonitor(event_log, blobs, settings.run_id)
    monitor.start()
    first_index = await prompts_in_log(event_log, settings.run_id)
    driver = PromptDriver(event_log, settings.run_id, options, cfg, first_index)
    supervisor = Supervisor(run_dir / "logs")
    for spec in worker_specs(
        options,
        base_env=_base_env(settings, config),
        model_dir=model_dir,
        state_dir=settings.state_dir.resolve(),
        max_version=target,
    ):
        supervisor.add(spec)

    stop = stop_on_signals(signal.SIGHUP)
    live_wanted = options.live if options.live is not None else out.console.is_terminal
    # Groups the remaining updates can use: published groups are never wasted beyond the last update.
    groups_needed = (target - start_version) * options.groups_per_batch
    phase = "starting workers"
    interrupted = False
    last_line = 0.0
    await _wait_caught_up(monitor, start_version if head is not None else None, first_index)
    stop_after = first_index + groups_needed + options.groups_ahead
    live = Live(console=out.console, refresh_per_second=4, transient=False) if live_wanted else None
    try:
        if live is not None:
            live.start()
        trainer = supervisor.workers["trainer"]
        shown_events = 0
        while True:
            supervisor.poll()
            state = monitor.state
            if state.head is not None:
                phase = "training"
                await driver.top_up(state.trained_groups(), stop_after)
            if trainer.finished:
                break
            for worker in supervisor.workers.values():
                if worker.crash_streak > 5:
                    raise SprawlError(
                        f"{worker.spec.name} keeps crashing ({worker.crash_streak} times in a row, "
                        f"last exit {worker.last_exit})",
                        hint=f"its log is {worker.log_file}",
                    )
            if stop.is_set():
                interrupted = True
                break
            if live is not None:
                live.update(render(state, supervisor, phase=phase, target=target))
            else:
                for event in supervisor.events[shown_events:]:  # restarts are news: print them at once
                    out.print(f"[{time.time() - state.started_at:6.0f}s] {event}")
                shown_events = len(supervisor.events)
            if live is None and time.monotonic() - last_line > 10:
                last_line = time.monotonic()
                out.print(progress_line(state, phase=phase, target=target))
            await asyncio.sleep(0.25)
        phase = "interrupted: stopping workers" if interrupted else "finishing: draining workers"
        if live is not None:
            live.update(render(monitor.state, supervisor, phase=phase, target=target))
        await asyncio.to_thread(supervisor.stop)
        if live is not None:
            live.update(render(monitor.state, supervisor, phase=phase, target=target))
    finally:
        if live is not None:
            live.stop()
        await asyncio.to_thread(supervisor.stop)  # idempotent: nothing is left behind on any exit
    report_path = None
    if not interrupted:
        report_path = await _archive_and_report(settings, config, run_dir, out)
    await asyncio.sleep(0.5)  # the monitor reads the last rewards and heartbeats
    await monitor.stop()
    await event_log.close()
    summary, text = summarize(
        monitor.state,
        supervisor,
        options,
        wall_s=time.monotonic() - t0,
        report=report_path,
        start_version=start_version,
        interrupted=interrupted,
    )
    out.print(text)
    return UpResult(settings.run_id, summary, interrupted)


async def _wait_caught_up(monitor, head: int | None, prompts: int, timeout_s: float = 30.0) -> None:
    """Let the monitor replay the run so far before the driver sizes its window on it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = monitor.state
        if (head is None or (state.head or 0) >= head) and state.prompts_published >= prompts:
            return
        await asyncio.sleep(0.1)


async def _archive_and_report(settings, config: Path | None, run_dir: Path, out: _Output) -> Path | None:
    from pipeline.audit import open_archive
    from pipeline.config import load_settings
    from workers.archiver import ArchiverSettings, drain_once
    from workers.up.report import write_report

    # The archiver worker's own settings (TOML and environment included), at the stack `up` runs on.
    archiver_settings = load_settings(
        ArchiverSettings,
        config,
        run_id=settings.run_id,
        state_dir=settings.state_dir,
        nats=settings.nats,
        blobs=settings.blobs,
    )
    archived = await drain_once(archiver_settings)
    log.info("archive drained", events=archived)

    def _report() -> Path:
        con, views = open_archive(settings)
        return write_report(con, views, settings.run_id, run_dir / "report.html")

    try:
        return await asyncio.to_thread(_report)
    except SprawlError as exc:
        out.print(f"report not written: {exc}")
        return None
