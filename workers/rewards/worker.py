"""The reward worker: trajectory events in, one Reward event per trajectory id out.

It follows the run's prompt groups (a projection of the PROMPTS stream: the reference answers and
hidden tests live there, not in the trajectories), routes each trajectory by its task to a
verifier, runs model-written code only inside the sandbox, and publishes the reward with the
trajectory id as its business key, so a redelivery or a SIGKILL mid-verification never doubles it:
the log keeps one reward per trajectory subject, so a trajectory that already has one is acked
without verifying it again, and a reward another worker stored first (`SubjectTaken`) is done.

The prompt projection follows the log through its own named consumer (`pipeline.replay.Follower`),
so it waits out a nats-server restart or outage; it is supervised (`run_beside`): if it ends, the
worker stops. A trajectory whose group the projection has not seen is retried later while the
projection is behind the log, and dead-lettered (`unknown_group`) once it has read everything the
log held and the group is not there.

The sandbox is opened only when a routed verifier executes model output (`needs_sandbox`): a
worker that only checks exact answers runs without bubblewrap, and one that does run code fails at
start, in one line naming the package, when bubblewrap is missing.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import nats.js.errors
from pydantic import Field, field_validator

from pipeline.config import SprawlSettings
from pipeline.consumer import Consumer, Delivery
from pipeline.errors import LogUnavailable, PoisonEvent, SubjectTaken, TransientError
from pipeline.eventlog import NO_ANSWER, EventLog
from pipeline.log_lookup import count_subjects
from pipeline.logs import get_logger
from pipeline.replay import Follower, decoded
from pipeline.sandbox import Sandbox, SandboxSettings, SandboxUnavailable, open_sandbox
from pipeline.subjects import reward_subject
from pipeline.topology import PROMPTS, REWARDS, ConsumerRole, consumer_for, follower_name, prompts_filter
from schemas import PromptGroup, Reward, Trajectory
from workers.lifecycle import run_beside, run_connected
from workers.rewards.verifiers import VERIFIERS, Verifier, verifier

log = get_logger(__name__)


class RewardSettings(SprawlSettings):
    sandbox: SandboxSettings = SandboxSettings()
    """Where verifier programs run (opened only when a routed verifier needs it)."""
    concurrency: int = Field(4, ge=1)
    """Trajectories verified at once (the warm pool should be at least this large)."""
    routes: dict[str, str] = {"arith": "exact", "exact": "exact", "format": "format", "math_word": "number"}
    """Task -> verifier (a key of `VERIFIERS`): the prompt group's `task` (the addition demo's is `arith`,
    a file task's is its name) to the verifier that scores it. `sprawl up` adds its task's route
    (`workers/tasks/registry.py`). Code tasks are opt-in because they need bubblewrap:
    e.g. SPRAWL_ROUTES='{"arith": "exact", "code": "code_tests"}'."""
    prompt_wait_s: float = Field(30.0, gt=0)
    """How long a trajectory may wait for its prompt group to show up before it is retried later."""

    @field_validator("routes")
    @classmethod
    def _registered_verifiers(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted({name for name in value.values() if name not in VERIFIERS})
        if unknown:
            raise ValueError(
                f"unknown verifier{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
                f"route tasks to {', '.join(sorted(VERIFIERS))}"
            )
        return value


def routed_verifiers(settings: RewardSettings) -> dict[str, Verifier]:
    """Task -> verifier, as configured; an unknown verifier name is an error at start."""
    return {task: verifier(name) for task, name in settings.routes.items()}


def open_verifier_sandbox(settings: RewardSettings) -> Sandbox | None:
    """The sandbox the routed verifiers need, checked but not started; None when none executes code."""
    needing = {task: v.name for task, v in routed_verifiers(settings).items() if v.needs_sandbox}
    if not needing:
        return None
    try:
        return open_sandbox(settings.sandbox)
    except SandboxUnavailable as exc:
        routes = ", ".join(f"{task!r} -> {name}" for task, name in sorted(needing.items()))
        raise SandboxUnavailable(
            f"reward routes {routes} run model-written code in a sandbox, but {exc.message}",
            hint=f"{exc.hint}; or route no task to a sandboxed verifier (SPRAWL_ROUTES)",
        ) from exc


class RewardWorker:
    def __init__(self, settings: RewardSettings, event_log: EventLog, sandbox: Sandbox | None):
        self.settings = settings
        self.log = event_log
        self.verifiers = routed_verifiers(settings)
        missing = sorted(task for task, v in self.verifiers.items() if v.needs_sandbox and sandbox is None)
        if missing:
            raise SandboxUnavailable(
                f"tasks {', '.join(missing)} are routed to a verifier that needs a sandbox, and none was given",
                hint="open one with open_verifier_sandbox(settings)",
            )
        self.sandbox = sandbox
        self.groups: dict[str, PromptGroup] = {}
        self.prompts_read_through = 0
        """The last PROMPTS sequence the projection has applied (whatever the message held)."""
        self._group_seen = asyncio.Condition()
        self.verified = 0
        self.already_rewarded = 0
        # Each worker follows the prompts itself, from the start, so its consumer is its own.
        reader = f"rewards-{uuid.uuid4().hex[:8]}"
        self.prompt_feed = Follower(
            event_log, PROMPTS.name, prompts_filter(settings.run_id), 1, follower_name(settings.run_id, reader, PROMPTS)
        )

    async def _follow_prompts(self, stop: asyncio.Event) -> None:
        async for msg in self.prompt_feed.messages(stop):
            item = await decoded(self.log, msg)
            async with self._group_seen:
                if item is not None and isinstance(item.event, PromptGroup):
                    self.groups[item.event.group_id] = item.event
                self.prompts_read_through = msg.metadata.sequence.stream
                self._group_seen.notify_all()

    async def _group_of(self, trajectory: Trajectory) -> PromptGroup:
        """The trajectory's prompt group. A group the projection has not seen is waited for while the
        projection is behind the log; once it has read all the log held when asked, a group it still
        has not seen is not in the log: the trajectory is poison (`unknown_group`)."""
        if (group := self.groups.get(trajectory.group_id)) is not None:
            return group
        head = await self._prompts_head()
        async with self._group_seen:
            try:
                await asyncio.wait_for(
                    self._group_seen.wait_for(
                        lambda: trajectory.group_id in self.groups or self.prompts_read_through >= head
                    ),
                    self.settings.prompt_wait_s,
                )
            except TimeoutError:
                raise TransientError(  # nak: retry later
                    f"prompt group {trajectory.group_id} not seen yet: the prompt projection has read through "
                    f"sequence {self.prompts_read_through}, the log holds prompts up to {head}"
                ) from None
        if (group := self.groups.get(trajectory.group_id)) is not None:
            return group
        raise PoisonEvent(
            f"trajectory {trajectory.trajectory_id} names prompt group {trajectory.group_id}, which the log does "
            f"not hold (its prompts read through sequence {head})",
            error_class="unknown_group",
        )

    async def _prompts_head(self) -> int:
        """The stream sequence of the run's newest prompt message (0: none), on the server's word."""
        try:
            last = await self.log.js.get_last_msg(PROMPTS.name, prompts_filter(self.settings.run_id))
        except nats.js.errors.NotFoundError:
            return 0
        except NO_ANSWER as exc:
            raise LogUnavailable("reading the newest prompt group's position", exc) from exc
        return last.seq

    async def _rewarded(self, trajectory: Trajectory) -> bool:
        """Whether the log already holds a reward for this trajectory id (one subject per trajectory)."""
        subject = reward_subject(trajectory.run_id, trajectory.group_id, trajectory.trajectory_id)
        return await count_subjects(self.log, REWARDS.name, subject) > 0

    async def handle(self, delivery: Delivery) -> None:
        trajectory = delivery.event
        if not isinstance(trajectory, Trajectory):
            raise PoisonEvent(f"expected a trajectory, got {type(trajectory).type_tag()}", error_class="wrong_event")
        verifier = self.verifiers.get(trajectory.task)
        if verifier is None:
            raise PoisonEvent(
                f"no verifier for task {trajectory.task!r} (routes: {', '.join(sorted(self.verifiers))})",
                error_class="no_verifier",
            )
        if await self._rewarded(trajectory):  # a redelivery after a kill, or a republished trajectory
            self.already_rewarded += 1
            return
        group = await self._group_of(trajectory)
        started = time.perf_counter()
        verdict = await verifier.verify(trajectory, group, self.sandbox)
        try:
            await self.log.append(
                Reward(
                    run_id=trajectory.run_id,
                    trajectory_id=trajectory.trajectory_id,
                    group_id=trajectory.group_id,
                    value=verdict.value,
                    verifier=verifier.name,
                    verifier_version=verifier.version,
                    duration_s=time.perf_counter() - started,
                    components=verdict.components,
                    sandbox_id=verdict.sandbox_id,
                    error_class=verdict.error_class,
                    format_error=verdict.format_error,
                    details=verdict.details,
                )
            )
        except SubjectTaken:  # another worker rewarded it first: one reward per trajectory is what we want
            self.already_rewarded += 1
            return
        self.verified += 1

    async def run(self, stop: asyncio.Event) -> None:
        if self.sandbox is not None:
            await self.sandbox.start()
        prompts = asyncio.create_task(self._follow_prompts(stop))
        trajectories = consumer_for(self.settings.run_id, ConsumerRole.REWARDS)
        consumer = Consumer(
            self.log,
            trajectories.stream.name,
            trajectories.name,
            self.handle,
            batch=self.settings.concurrency,
            concurrency=self.settings.concurrency,
            fetch_timeout_s=0.5,
            transient_retry_s=self.settings.streams.transient_retry_s,
            bug_attempts=self.settings.streams.bug_attempts,
        )
        try:
            # Without the prompt projection every trajectory would wait, then be dead-lettered.
            await run_beside(consumer.run(stop), prompts, stop, "the reward worker's prompt projection")
        finally:
            if self.sandbox is not None:
                await self.sandbox.close()


async def run_rewards(settings: RewardSettings) -> None:
    sandbox = open_verifier_sandbox(settings)  # before connecting: a missing bubblewrap fails the start

    async def body(event_log: EventLog, stop: asyncio.Event) -> None:
        await RewardWorker(settings, event_log, sandbox).run(stop)

    await run_connected(settings, "rewards", body)
