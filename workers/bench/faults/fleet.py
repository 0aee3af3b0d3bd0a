"""A small real run to inject faults into: a private stack, the workers as `sprawl` processes, prompts.

The stack is nats-server + SeaweedFS under the run's state folder, on ports chosen as they bind. The
workers are what `sprawl up` starts, from the same plans (`workers.up.orchestrate.worker_plans`: the
trainer, one island per view, the reward worker, the archiver), each a `python -m workers.cli
<worker> --config <file>` process under `up`'s supervisor, which restarts a worker that dies. The
prompt driver runs here, in the harness's process, and records the stream sequence of every prompt
group the log acknowledged: those are events a producer was told are stored, so none may go missing.

Every server and worker is stopped by pid on `close`, whatever happened before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import nats.errors

from infra import stack
from infra.stack import ServerRecord, StackSection
from pipeline.errors import SprawlError, StackError
from pipeline.eventlog import EventLog
from pipeline.logs import get_logger
from pipeline.version_log import chain_head

log = get_logger(__name__)

LOG_TROUBLE = (SprawlError, nats.errors.Error, TimeoutError, OSError)
"""What a harness call to the log or the store may raise while a fault is on: noted, retried later."""


@dataclass(frozen=True)
class FleetShape:
    """How big the run under fire is: small, so a fault's effect shows within a few versions."""

    islands: int = 1
    """Sampler islands, bf16 and fp8 in turn (the trainer publishes the views they serve)."""
    groups_per_batch: int = 2
    group_size: int = 4
    groups_ahead: int = 4
    """Prompt groups published beyond what the trainer has taken."""
    warmup_steps: int = 30
    """Supervised steps of the base policy (cached in `model_root`): enough for non-zero rewards."""

    @property
    def views(self) -> list[str]:
        return ["bf16", "fp8_e4m3"][: max(1, min(self.islands, 2))]


@dataclass
class AckedAppend:
    stream: str
    seq: int
    msg_id: str


@dataclass
class PromptFeed:
    """The prompt driver: keeps `groups_ahead` groups beyond what the trainer has trained on, and
    remembers every append the log acknowledged."""

    event_log: EventLog
    settings: object  # UpSettings
    acked: list[AckedAppend] = field(default_factory=list)
    next_index: int = 0
    troubles: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        from workers.up.demo_task import VOCAB_SIZE, prompt_group

        s = self.settings
        while not stop.is_set():
            try:
                head = await chain_head(self.event_log, s.run_id)
                trained = (head.version if head is not None else 0) * s.trainer.groups_per_batch
                while self.next_index < trained + s.prompts.groups_ahead and not stop.is_set():
                    group = prompt_group(
                        s.run_id,
                        self.next_index,
                        s.task,
                        n_samples=s.trainer.group_size,
                        top_p=s.prompts.top_p,
                        top_logprobs=VOCAB_SIZE,
                    )
                    result = await self.event_log.append(group)
                    if not result.duplicate:
                        self.acked.append(AckedAppend(result.stream, result.seq, result.msg_id))
                    self.next_index += 1
            except LOG_TROUBLE as exc:  # a fault is on: the same group (same msg id) is appended again later
                self.troubles += 1
                log.info("prompt feed waits for the log", error=repr(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)


class Fleet:
    """The run: `await start()`, inject faults, `await close()` (idempotent, in `finally`)."""

    def __init__(self, state_dir: Path, shape: FleetShape, *, run_id: str, model_root: Path | None = None):
        self.state_dir = state_dir
        self.shape = shape
        self.run_id = run_id
        self.model_root = model_root or state_dir
        self.settings = None  # UpSettings, pointed at the running stack by `start`
        self.servers: dict[str, ServerRecord] = {}
        self.every_server: list[ServerRecord] = []
        """Every server process this fleet started (a restarted nats-server adds one): all stopped by pid."""
        self.supervisor = None
        self.plans: list = []
        self.event_log: EventLog | None = None
        self.feed: PromptFeed | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    # ---------------------------------------------------------------- start

    async def start(self, start_timeout_s: float) -> None:
        from infra.streams import apply
        from workers.up.demo_task import warmed_up_model
        from workers.up.options import UpOptions, UpSettings, run_settings
        from workers.up.orchestrate import worker_plans, worker_specs
        from workers.up.supervisor import Supervisor

        shape = self.shape
        options = UpOptions(islands=shape.islands, views=",".join(shape.views), versions=1_000_000, live=False)
        section = StackSection(
            nats_port=0, nats_monitor_port=0, s3_port=0, seaweed_port_base=0, start_timeout_s=start_timeout_s
        )
        settings = run_settings(
            options,
            UpSettings(
                run_id=self.run_id,
                state_dir=self.state_dir,
                log_format="json",
                stack=section,
                trainer={"groups_per_batch": shape.groups_per_batch, "group_size": shape.group_size},
                task={"digits": 1, "warmup_steps": shape.warmup_steps, "warmup_batch": 16},
                prompts={"groups_ahead": shape.groups_ahead},
            ),
        )
        st = await asyncio.to_thread(stack.up, settings)
        for server in st.servers:
            self.servers[server.name] = server
            self.every_server.append(server)
        self.settings = settings = stack.with_endpoints(settings, st)
        self.event_log = await EventLog.connect(settings, worker="faults")
        await apply(self.event_log.js, settings.streams, settings.run_id)
        model_dir = await asyncio.to_thread(warmed_up_model, self.model_root, settings.task)
        run_dir = self.run_dir
        self.plans = worker_plans(settings, options, model_dir=model_dir, max_version=options.target_versions)
        self.supervisor = Supervisor(run_dir / "logs")
        for spec in worker_specs(self.plans, run_dir / "config"):
            self.supervisor.add(spec)
        self.feed = PromptFeed(self.event_log, settings)
        self._tasks = [
            asyncio.create_task(self.feed.run(self._stop), name="prompt-feed"),
            asyncio.create_task(self._supervise(), name="supervisor"),
        ]

    async def _supervise(self) -> None:
        while not self._stop.is_set():
            self.supervisor.poll()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=0.25)

    # ---------------------------------------------------------------- what the fleet is

    @property
    def run_dir(self) -> Path:
        return self.state_dir.resolve() / "runs" / self.run_id

    def worker_names(self, command: str) -> list[str]:
        """The workers running `command` (`trainer`, `sampler`, `rewards`, `archiver`)."""
        return [p.name for p in self.plans if p.command == command]

    def settings_of(self, name: str):
        return next(p.settings for p in self.plans if p.name == name)

    def island_dirs(self) -> dict[str, Path]:
        """Island id -> its version cache for this run's view (`<state>/islands/<id>/<run>/<view>`)."""
        out = {}
        for plan in self.plans:
            if plan.command == "sampler":
                island = plan.settings.island
                out[island.island_id] = island.materialize.cache_dir.resolve() / self.run_id / island.view
        return out

    def supervisor_events(self) -> list[str]:
        return list(self.supervisor.events) if self.supervisor is not None else []

    def check_workers_alive(self) -> None:
        """A worker that keeps crashing will not bring the run back: say so instead of waiting on."""
        for worker in self.supervisor.workers.values():
            if worker.crash_streak > 5:
                raise SprawlError(
                    f"{worker.spec.name} keeps crashing ({worker.crash_streak} times, last exit {worker.last_exit})",
                    hint=f"its log is {worker.log_file}",
                )

    async def head_version(self) -> int | None:
        """The chain's head, or None when the log does not answer (a fault is on)."""
        try:
            head = await chain_head(self.event_log, self.run_id)
        except LOG_TROUBLE:
            return None
        return head.version if head is not None else 0

    async def wait_for_version(self, version: int, guard_s: float) -> bool:
        """Until the chain reaches `version`; False when `guard_s` passed first (the run stalled)."""
        deadline = time.monotonic() + guard_s
        while time.monotonic() < deadline:
            self.check_workers_alive()
            head = await self.head_version()
            if head is not None and head >= version:
                return True
            await asyncio.sleep(0.5)
        return False

    # ---------------------------------------------------------------- processes the faults act on

    def worker_pid(self, name: str) -> int:
        worker = self.supervisor.workers[name]
        if worker.process is None or worker.process.poll() is not None:
            raise SprawlError(f"{name} is not running", hint=f"its log is {worker.log_file}")
        return worker.process.pid

    def server_pid(self, name: str) -> int:
        return self.servers[name].pid

    def nats_port(self) -> int:
        port = urlparse(self.settings.nats.url).port
        assert port is not None, self.settings.nats.url
        return port

    def kill_server(self, name: str) -> None:
        """SIGKILL a server and reap it (it is our child), so its pid is gone when this returns."""
        pid = self.servers[name].pid
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    def restart_nats(self, attempts: int = 30) -> ServerRecord:
        """nats-server again, from the same store and on the same port (the workers' URL). The port may
        be briefly taken by someone else's outgoing connection: tried again a few times."""
        section = self.settings.stack.model_copy(update={"nats_port": self.nats_port(), "nats_monitor_port": 0})
        directory = stack.stack_dir(self.settings)
        for attempt in range(1, attempts + 1):
            try:
                record = stack.start_nats(directory, section)
                break
            except StackError:
                if attempt == attempts:
                    raise
                time.sleep(1.0)
        self.servers["nats"] = record
        self.every_server.append(record)
        return record

    # ---------------------------------------------------------------- stop

    async def stop_workers(self) -> None:
        """SIGTERM every worker (they drain), SIGKILL what is left after the grace; no restarts after."""
        if self.supervisor is not None:
            await asyncio.to_thread(self.supervisor.stop)

    async def stop_feed(self) -> None:
        self._stop.set()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def close(self) -> None:
        await self.stop_feed()
        await self.stop_workers()
        if self.event_log is not None:
            await self.event_log.close()
            self.event_log = None
        await asyncio.to_thread(stack.stop_servers, list(self.every_server))
        if self.settings is not None:
            await asyncio.to_thread(stack.down, self.settings)
