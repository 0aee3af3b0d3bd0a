"""`sprawl up`: the stack, the whole fleet as supervised processes, a real short RL run, a summary.

Phases: the task and `--model` checked (`workers/tasks/`: a task that cannot run fails here, before
anything starts); stack up (or reuse) and streams declared; the base policy built and warmed up
(cached), or `--model`'s checkpoint taken as it is;
trainer, sampler islands (a mixed-precision fleet: one view each), reward worker and archiver
started under a supervisor; a prompt driver keeps a bounded number of prompt groups ahead of the
trainer (so staleness stays small without any lockstep); the run ends when the trainer publishes
its last version. Each worker gets its settings as a TOML file derived from the run's `UpSettings`
(`<state_dir>/runs/<run>/config/<worker>.toml`, owner-only), which it validates at start. Then
the workers drain, the archive is brought up to date, the HTML report is written and the summary
printed. Ctrl-C, SIGTERM or SIGHUP at any phase stops every worker (and the stack, if this
command started it) within seconds, with exit code 128 + the signal (`workers/up/stopping.py`);
the warm-up runs in a child process so that it can be stopped too. A second `sprawl up` continues
the previous run from the log; `--fresh` starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pipeline.config import SprawlSettings, TrustSettings, write_settings_file
from pipeline.errors import SprawlError
from pipeline.logs import get_logger
from workers.tasks.registry import Task, TaskError, resolve_task
from workers.up.options import UpOptions, UpSettings, correction_of, island_views, run_settings
from workers.up.stopping import Stopped, StopSignals, exit_code, signal_name

log = get_logger(__name__)


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


# ---------------------------------------------------------------- the task and the model


@dataclass
class RunTask:
    """What the run trains on, checked before anything starts."""

    task: Task
    model: Path | None
    """`--model`'s checkpoint directory (resolved), or None: the base policy is built and warmed up."""
    prompts: object | None = None
    """The task's `TaskPrompts` when `--model` already decides how prompts render (every row checked)."""


def prepare_task(options: UpOptions, settings: UpSettings) -> RunTask:
    """The run's task resolved and `--model` checked: a missing file, a row without its fields, a
    model without config.json or tokenizer, a prompt the model cannot take: one clear error, now."""
    from workers.tasks.model_dir import check_model_dir
    from workers.tasks.sources import load_rows

    task = resolve_task(settings.task.name, settings.tasks)
    if task.spec is not None:  # a relative source is the working directory's, in the warm-up child too
        task = Task(task.name, task.spec.model_copy(update={"source": task.spec.source.resolve()}))
    model = check_model_dir(options.model) if options.model is not None else None
    if model is not None:
        from workers.tasks.prompts import TaskPrompts

        return RunTask(task, model, TaskPrompts(task, digits=settings.task.digits, model_dir=model))
    if task.spec is not None:
        load_rows(task.spec)
    return RunTask(task, None)


def check_same_task(run_dir: Path, run: RunTask) -> None:
    """A run trains one task from one model: continuing it with another is refused (the trainer would
    restore a checkpoint of another model, the log would mix tasks). Runs from before tasks had names
    were the addition demo on its own model."""
    import json

    record = run_dir / "task.json"
    wanted = {"task": run.task.name, "model": None if run.model is None else str(run.model)}
    if record.exists():
        held = json.loads(record.read_text())
    elif (run_dir / "config").exists():  # a run `up` started before it recorded its task
        held = {"task": "addition", "model": None}
    else:
        held = wanted
    if held != wanted:
        was = f"task {held['task']!r}" + (f" on --model {held['model']}" if held.get("model") else "")
        now = f"task {wanted['task']!r}" + (f" on --model {wanted['model']}" if wanted["model"] else "")
        raise TaskError(
            f"run {run_dir.name} trains {was}; this invocation asks for {now}",
            hint="`--fresh` starts a new run (or give the same --task.name and --model)",
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(wanted) + "\n")


# ---------------------------------------------------------------- what each worker runs with


@dataclass
class WorkerPlan:
    """One worker of the run: its command and the settings it will validate at start."""

    name: str
    command: str
    """The `sprawl` command that runs it."""
    settings: SprawlSettings
    labels: dict[str, str]


@dataclass(frozen=True)
class RunTrust:
    signer: TrustSettings
    """The trainer's: the key it signs versions with."""
    verifier: TrustSettings
    """Everyone else's: the public key islands pin."""


def signing_key_path(state_dir: Path) -> Path:
    """Where `sprawl up` keeps the trainer's version-signing key (made on the first run, kept after)."""
    return state_dir.resolve() / "keys" / "version-signing-key.pem"


def run_trust(settings: SprawlSettings) -> RunTrust:
    """Signed versions unless the run opted out: the configured keys, else a key of this state folder's
    own (the islands `up` starts pin its public half; join tokens carry it to islands elsewhere)."""
    from pipeline.config import TrustSettings
    from pipeline.version_signing import ensure_signing_key, load_signing_key, public_key_text

    trust = settings.trust
    if trust.signing_key_file is None and trust.allow_unsigned_versions:
        return RunTrust(trust, trust)
    key_file = trust.signing_key_file or signing_key_path(settings.state_dir)
    public = (
        ensure_signing_key(key_file) if trust.signing_key_file is None else public_key_text(load_signing_key(key_file))
    )
    return RunTrust(TrustSettings(signing_key_file=key_file), TrustSettings(version_public_key=public))


def worker_plans(settings: UpSettings, options: UpOptions, *, model_dir: Path, max_version: int) -> list[WorkerPlan]:
    """Every worker's settings, derived from the run's: the shared sections as they are, the trainer's
    and chain's from `settings`, one island per view in turn (none with --no-local-islands). Values `up`
    does not set come from the worker's defaults and the `SPRAWL_...` environment `up` was started with."""
    from infra import stack
    from pipeline.config import load_settings
    from workers.archiver import ArchiverSettings
    from workers.rewards.worker import RewardSettings
    from workers.sampler.worker import SamplerSettings
    from workers.tasks.model_dir import top_logprobs_for
    from workers.trainer.settings import TrainerSettings
    from workers.up.demo_task import VOCAB_SIZE

    task = resolve_task(settings.task.name, settings.tasks)
    if (model_dir / "config.json").is_file():
        top_logprobs = top_logprobs_for(model_dir, settings.prompts.top_logprobs)
    else:  # planned before the demo's model is built: its vocabulary, as the demo's prompt groups ask
        top_logprobs = min(settings.prompts.top_logprobs or VOCAB_SIZE, VOCAB_SIZE)
    state_dir = settings.state_dir.resolve()
    trust = run_trust(settings)
    shared = {
        "run_id": settings.run_id,
        "state_dir": state_dir,
        "log_format": "json",
        "log_level": settings.log_level,
        "nats": settings.nats,
        "blobs": settings.blobs,
        "log": settings.log,
        "streams": settings.streams,
    }

    def as_role(role: str) -> dict[str, object]:
        """The shared sections with `role`'s own identity on a secure stack, and what it must trust."""
        own = stack.with_role(settings, role)
        return {
            **shared,
            "nats": own.nats,
            "blobs": own.blobs,
            "trust": trust.signer if role == "trainer" else trust.verifier,
        }

    trainer = settings.trainer.model_copy(
        update={
            "model_dir": model_dir,
            "trainer_id": f"up-{socket.gethostname()}".lower(),
            "max_versions": max_version,
        }
    )
    plans = [
        WorkerPlan(
            "trainer",
            "trainer",
            load_settings(TrainerSettings, None, **as_role("trainer"), trainer=trainer, chain=settings.chain),
            {"correction": correction_of(settings)},
        )
    ]
    for index, view in enumerate(island_views(options, settings)):
        island_id = f"island{index}-{view.split('_')[0]}"
        island = {
            "view": view,
            "island_id": island_id,
            "top_logprobs": top_logprobs,
            "poll_interval_s": 1.0,
            # The materializer adds <run>/<view>/ below this.
            "materialize": {"cache_dir": state_dir / "islands" / island_id},
        }
        sampler = load_settings(SamplerSettings, None, **as_role("sampler"), island=island, heartbeat_interval_s=2.0)
        plans.append(WorkerPlan(f"sampler-{island_id}", "sampler", sampler, {"island": island_id, "view": view}))
    rewards = load_settings(RewardSettings, None, **as_role("rewards"))
    # The run's task is scored by its own verifier, whatever else the routes say.
    rewards = rewards.model_copy(update={"routes": rewards.routes | {task.route: task.verifier}})
    plans.append(WorkerPlan("rewards", "rewards", rewards, {"task": task.name}))
    plans.append(WorkerPlan("archiver", "archiver", load_settings(ArchiverSettings, None, **as_role("archiver")), {}))
    return plans


def worker_env(threads: int = 1) -> dict[str, str]:
    """The workers' environment (the warm-up's too): ours without `SPRAWL_...` (a worker's settings
    file is the whole of its configuration), on `threads` threads (`trainer.threads`: a small
    machine's cores are shared by five processes), and able to import this checkout."""
    from workers.up.warmup import thread_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")}
    env = thread_env(env, threads) | {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    # Workers import the project from where this command runs (an editable install, or a checkout).
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def worker_specs(plans: list[WorkerPlan], config_dir: Path, *, threads: int = 1) -> list:
    """Each plan's settings written to `<config_dir>/<name>.toml` (owner-only: it holds credentials),
    and the command that starts the worker on it."""
    from workers.up.supervisor import WorkerSpec

    config_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(config_dir, 0o700)
    env = worker_env(threads)
    specs = []
    for plan in plans:
        path = write_settings_file(plan.settings, config_dir / f"{plan.name}.toml")
        argv = [sys.executable, "-m", "workers.cli", plan.command, "--config", str(path)]
        specs.append(WorkerSpec(plan.name, argv, env, labels=plan.labels))
    return specs


# ---------------------------------------------------------------- the run


@dataclass
class UpResult:
    run_id: str
    summary: dict
    interrupted: bool
    stopped_by: int | None = None
    """The signal that stopped the run (its exit code is 128 + it), or None."""

    @property
    def exit_code(self) -> int:
        return 0 if self.stopped_by is None else exit_code(self.stopped_by)


class _Output:
    """Human output goes to stdout, or to stderr when stdout is reserved for `--json`."""

    def __init__(self, json_output: bool):
        from rich.console import Console

        self.console = Console(file=sys.stderr if json_output else sys.stdout, highlight=False)
        if not self.console.is_terminal:
            self.console.width = 200  # logs and pipes: one line per line, not wrapped at 80 columns

    def print(self, *args, **kwargs) -> None:
        self.console.print(*args, **kwargs)


@dataclass
class _Progress:
    """Where the run is, for the "stopped" line and the summary of a run stopped early."""

    phase: str = "starting the stack"
    started_stack: bool = False


def run_up(options: UpOptions, settings: UpSettings) -> UpResult:
    """The whole run. `settings.run_id` is used when it was given (flag, variable or file); else the
    previous run continues, unless `options.fresh`. A stop signal at any phase stops everything that
    was started (`workers/up/stopping.py`) and returns a result with `stopped_by` set."""
    from infra import stack
    from pipeline.logs import configure_logging
    from pipeline.subjects import token

    out = _Output(options.json_output)
    signals = StopSignals()
    progress = _Progress()
    state_dir = settings.state_dir
    explicit = settings.run_id if "run_id" in settings.model_fields_set else None
    run_id, continuing = choose_run_id(state_dir, explicit, options.fresh)
    token(run_id, "run_id")  # a remembered id was checked when it was first used; check again
    settings = run_settings(options, settings).model_copy(update={"run_id": run_id})
    run_dir = state_dir.resolve() / "runs" / run_id
    run = prepare_task(options, settings)  # before anything starts: a task that cannot run fails now
    check_same_task(run_dir, run)
    # Our own logs go to a file: the terminal belongs to the live view.
    run_dir.mkdir(parents=True, exist_ok=True)
    configure_logging(run_id, "json", settings.log_level, file=run_dir / "up.log")

    started = time.monotonic()
    try:
        with signals.raising(lambda: progress.phase):
            had_stack = stack.status(settings) is not None or bool(stack.dead_servers(settings))
            st = stack.up(settings)  # a half-started stack is stopped by `up` itself on the way out
            progress.started_stack = not had_stack
            what = "reused" if st.already_running else ("repaired" if had_stack else "started")
            out.print(f"stack {what}: nats {st.nats_url}, s3 {st.s3_endpoint}")
            for action in st.actions if had_stack else []:
                out.print(f"  {action}")
            settings = stack.with_endpoints(settings, st)
            remember_run(state_dir, run_id)
            # Until the event loop watches the signals itself, they still raise here.
            result = asyncio.run(_run(options, settings, run, run_dir, continuing, out, started, signals, progress))
    except Stopped as stopped:
        name = signal_name(stopped.signum)
        summary = {"run_id": run_id, "interrupted": True, "stopped_by": name, "phase": stopped.phase}
        summary["wall_s"] = round(time.monotonic() - started, 1)
        result = UpResult(run_id, summary, True, stopped.signum)
    if result.stopped_by is not None:
        with signals.ignoring():
            stopped_stack = stack.down(settings) if progress.started_stack else []
        log.warning("stopped", signal=signal_name(result.stopped_by), phase=progress.phase)
        out.print(
            f"stopped by {signal_name(result.stopped_by)} during {progress.phase}: every worker stopped"
            + (f", the stack stopped ({', '.join(stopped_stack)})" if stopped_stack else "")
        )
    return result


async def _run(
    options: UpOptions,
    settings: UpSettings,
    run: RunTask,
    run_dir: Path,
    continuing: bool,
    out: _Output,
    t0: float,
    signals: StopSignals,
    progress: _Progress,
) -> UpResult:
    from pipeline.eventlog import EventLog

    signals.watch()
    progress.phase = "connecting to the log"
    event_log = await signals.until_stopped(EventLog.connect(settings, worker="up"), progress.phase)
    try:
        return await _run_connected(options, settings, run, run_dir, continuing, out, t0, signals, progress, event_log)
    finally:
        with contextlib.suppress(Exception):  # a dead server must not hide how the run ended
            await asyncio.wait_for(event_log.close(), timeout=10)


async def _run_connected(
    options: UpOptions,
    settings: UpSettings,
    run: RunTask,
    run_dir: Path,
    continuing: bool,
    out: _Output,
    t0: float,
    signals: StopSignals,
    progress: _Progress,
    event_log,
) -> UpResult:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from infra.streams import apply
    from pipeline.version_log import chain_head
    from workers.up.warmup import warm_up

    progress.phase = "declaring the streams"
    await signals.until_stopped(
        apply(event_log.js, settings.streams, settings.run_id, log=settings.log, nats=settings.nats), progress.phase
    )
    cfg, spec = settings.task, run.task.spec
    out.print(_task_line(run))

    if run.model is not None:
        model_dir = run.model  # --model: the checkpoint as it is, no warm-up
        out.print(f"base policy: {model_dir} (--model)")
    else:
        progress.phase = "warm-up"
        steps = cfg.warmup_steps if spec is None else spec.warmup_steps
        with Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
            console=out.console, transient=False, disable=options.json_output and not out.console.is_terminal,
        ) as bar:  # fmt: skip
            bar_task = bar.add_task("warm-up (cached after the first run)", total=steps, info="")

            def on_step(step: int, total: int, loss: float) -> None:
                bar.update(bar_task, completed=step, info=f"loss {loss:.3f}")

            threads = settings.trainer.threads  # the workers' budget, not one thread per core
            warming = warm_up(
                settings.state_dir, cfg, threads=threads, env=worker_env(threads), on_step=on_step, spec=spec
            )
            model_dir = await signals.until_stopped(warming, progress.phase)
            bar.update(bar_task, completed=steps)
        out.print(f"base policy: {model_dir}")
    if run.prompts is None and spec is not None:  # a file task renders with the base policy's tokenizer
        from workers.tasks.prompts import TaskPrompts

        run.prompts = TaskPrompts(run.task, digits=cfg.digits, model_dir=model_dir)

    progress.phase = "reading the run's head"
    head = await signals.until_stopped(chain_head(event_log, settings.run_id), progress.phase)
    start_version = head.version if head is not None else 0
    target = start_version + options.target_versions
    views = island_views(options, settings)
    fleet = f"{len(views)} islands: {', '.join(views)}" if views else "no local islands: islands join with tokens"
    out.print(
        f"run {settings.run_id}: "
        + (f"continuing from v{start_version}" if continuing and head is not None else "new run")
        + f", training to v{target} ({fleet}; correction {correction_of(settings)})"
    )
    return await _train(options, settings, run, run_dir, out, t0, signals, progress, event_log, model_dir, head, target)


def _task_line(run: RunTask) -> str:
    task = run.task
    if task.spec is None:
        return f"task {task.name} (generated problems; verifier {task.verifier})"
    template = task.spec.template if task.spec.template in ("model", "raw") else "the task's own"
    return f"task {task.name} (prompts from {task.spec.source}; template {template}; verifier {task.verifier})"


async def _train(
    options: UpOptions,
    settings: UpSettings,
    run: RunTask,
    run_dir: Path,
    out: _Output,
    t0: float,
    signals: StopSignals,
    progress: _Progress,
    event_log,
    model_dir: Path,
    head,
    target: int,
) -> UpResult:
    from rich.live import Live

    from pipeline.blobstore import open_blob_store
    from workers.up.live_view import progress_line, render
    from workers.up.monitor import RunMonitor
    from workers.up.prompt_driver import PromptDriver, prompts_in_log
    from workers.up.summary import summarize
    from workers.up.supervisor import Supervisor
    from workers.up.watchdog import StallWatchdog

    start_version = head.version if head is not None else 0
    blobs = open_blob_store(settings.blobs)
    monitor = RunMonitor(event_log, blobs, settings.run_id)
    monitor.start()
    supervisor = Supervisor(run_dir / "logs")
    signals.on_again.append(supervisor.kill_all)  # a second signal: no more draining
    live = None
    watchdog: StallWatchdog | None = None
    plans: list[WorkerPlan] = []
    try:
        progress.phase = "counting the run's prompts"
        first_index = await signals.until_stopped(prompts_in_log(event_log, settings.run_id), progress.phase)
        driver = PromptDriver(event_log, settings.run_id, settings, first_index, run.prompts)  # type: ignore[arg-type]
        plans = worker_plans(settings, options, model_dir=model_dir, max_version=target)
        progress.phase = "starting workers"
        for spec in worker_specs(plans, run_dir / "config", threads=settings.trainer.threads):
            supervisor.add(spec)

        live_wanted = options.live and out.console.is_terminal
        # Groups the remaining updates can use: published groups are never wasted beyond the last update.
        groups_needed = (target - start_version) * settings.trainer.groups_per_batch
        last_line = 0.0
        await signals.until_stopped(
            _wait_caught_up(monitor, start_version if head is not None else None, first_index), progress.phase
        )
        stop_after = first_index + groups_needed + settings.prompts.groups_ahead
        live = Live(console=out.console, refresh_per_second=4, transient=False) if live_wanted else None
        if live is not None:
            live.start()
        trainer = supervisor.workers["trainer"]
        shown_events = 0
        watchdog = StallWatchdog(settings.watchdog.stall_after_s)
        services = [monitor.bus, monitor.store]
        shown_stall: tuple[str, ...] | None = None
        while not signals.stopped:
            supervisor.poll()
            state = monitor.state
            stall = watchdog.check(state, supervisor, monitor.bus, monitor.store)
            if state.head is not None and monitor.bus.up:  # publishing to an absent bus would only wait
                progress.phase = "training"
                try:
                    await signals.until_stopped(driver.top_up(state.trained_groups(), stop_after), progress.phase)
                except Stopped:
                    break  # the workers are stopped below, and the run summarized
            if trainer.finished:
                break
            for worker in supervisor.workers.values():
                if worker.crash_streak > 5:
                    raise SprawlError(
                        f"{worker.spec.name} keeps crashing ({worker.crash_streak} times in a row, "
                        f"last exit {worker.last_exit}: {worker.last_reason or 'no reason printed'})",
                        hint=f"its log is {worker.log_file}",
                    )
            view = {"phase": progress.phase, "target": target, "services": services, "stall": stall}
            if live is not None:
                live.update(render(state, supervisor, **view))
            else:
                for event in supervisor.events[shown_events:]:  # restarts are news: print them at once
                    out.print(f"[{time.time() - state.started_at:6.0f}s] {event}")
                shown_events = len(supervisor.events)
                if stall is not None and stall.causes != shown_stall:  # a stall is news too
                    out.print(f"[{time.time() - state.started_at:6.0f}s] {stall.line()}", style="bold red")
                    last_line = time.monotonic()
            shown_stall = None if stall is None else stall.causes
            if live is None and time.monotonic() - last_line > 10:
                last_line = time.monotonic()
                out.print(progress_line(state, **view))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(signals.event.wait(), timeout=0.25)
        interrupted = signals.stopped
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
        if signals.stopped:  # the summary of an interrupted run is not worth waiting for: stop reading
            await monitor.stop()
    report_path = None
    if not interrupted:
        progress.phase = "archiving and writing the report"
        archiver = next(p.settings for p in plans if p.name == "archiver")
        try:
            report_path = await signals.until_stopped(_archive_and_report(settings, archiver, run_dir, out), "report")
        except Stopped:
            interrupted = True
    if not interrupted:
        await asyncio.sleep(0.5)  # the monitor reads the last rewards and heartbeats
    await monitor.stop()
    summary, text = summarize(
        monitor.state,
        supervisor,
        options,
        wall_s=time.monotonic() - t0,
        report=report_path,
        start_version=start_version,
        interrupted=interrupted,
    )
    summary["stalls"] = watchdog.fired if watchdog is not None else 0
    summary["task"] = run.task.name
    summary["model"] = str(model_dir)
    if signals.signum is not None:
        summary["stopped_by"] = signal_name(signals.signum)
    out.print(text)
    return UpResult(settings.run_id, summary, interrupted, signals.signum)


async def _wait_caught_up(monitor, head: int | None, prompts: int, timeout_s: float = 30.0) -> None:
    """Let the monitor replay the run so far before the driver sizes its window on it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = monitor.state
        if (head is None or (state.head or 0) >= head) and state.prompts_published >= prompts:
            return
        await asyncio.sleep(0.1)


async def _archive_and_report(settings, archiver_settings, run_dir: Path, out: _Output) -> Path | None:
    from pipeline.audit import open_archive
    from workers.archiver import drain_once
    from workers.up.report import write_run_report

    # The archiver worker's own settings: the drain archives exactly as the worker did.
    archived = await drain_once(archiver_settings)
    log.info("archive drained", events=archived)

    def _report() -> Path:
        con, views = open_archive(settings)
        return write_run_report(con, views, settings.run_id, run_dir)

    try:
        return await asyncio.to_thread(_report)
    except SprawlError as exc:
        out.print(f"report not written: {exc}")
        return None
