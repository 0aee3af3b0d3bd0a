"""The reward worker: trajectory events in, one Reward event per trajectory id out.

It follows the run's prompt groups (a projection of the PROMPTS stream: the reference answers and
hidden tests live there, not in the trajectories), routes each trajectory by its task to a
verifier, runs model-written code only inside the sandbox, and publishes the reward with the
trajectory id as its business key, so a redelivery or a SIGKILL mid-verification never doubles it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from pipeline.config import SprawlSettings
from pipeline.consumer import Consumer, Delivery
from pipeline.errors import PoisonEvent
from pipeline.eventlog import EventLog
from pipeline.logs import get_logger
from pipeline.replay import tail
from pipeline.sandbox import SandboxSettings, open_sandbox
from schemas import PromptGroup, Reward, Trajectory
from workers.lifecycle import run_connected
from workers.rewards.verifiers import VERIFIERS

log = get_logger(__name__)


class RewardSettings(SprawlSettings):
    sandbox: SandboxSettings = SandboxSettings()
    """Where verifier programs run."""
    concurrency: int = 4
    """Trajectories verified at once (the warm pool should be at least this large)."""
    routes: dict[str, str] = {"arith": "exact", "exact": "exact", "code": "code_tests", "format": "format"}
    """Task -> verifier."""
    prompt_wait_s: float = 30.0
    """How long a trajectory may wait for its prompt group to show up before it is retried later."""


class RewardWorker:
    def __init__(self, settings: RewardSettings, event_log: EventLog, sandbox):
        self.settings = settings
        self.log = event_log
        self.sandbox = sandbox
        self.groups: dict[str, PromptGroup] = {}
        self._group_seen = asyncio.Event()
        self.verified = 0

    async def _follow_prompts(self, stop: asyncio.Event) -> None:
        async for item in tail(self.log, "PROMPTS", f"rl.{self.settings.run_id}.prompts", 1, stop):
            if isinstance(item.event, PromptGroup):
                self.groups[item.event.group_id] = item.event
                self._group_seen.set()

    async def _group_of(self, trajectory: Trajectory) -> PromptGroup:
        deadline = time.monotonic() + self.settings.prompt_wait_s
        while trajectory.group_id not in self.groups:
            if time.monotonic() > deadline:
                raise RuntimeError(f"prompt group {trajectory.group_id} not seen yet")  # nak: retry later
            self._group_seen.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._group_seen.wait(), 0.5)
        return self.groups[trajectory.group_id]

    async def handle(self, delivery: Delivery) -> None:
        trajectory = delivery.event
        if not isinstance(trajectory, Trajectory):
            raise PoisonEvent(f"expected a trajectory, got {type(trajectory).type_tag()}", error_class="wrong_event")
        group = await self._group_of(trajectory)
        verifier_name = self.settings.routes.get(trajectory.task)
        if verifier_name is None or verifier_name not in VERIFIERS:
            raise PoisonEvent(f"no verifier for task {trajectory.task!r}", error_class="no_verifier")
        verifier = VERIFIERS[verifier_name]
        started = time.perf_counter()
        verdict = await verifier.verify(trajectory, group, self.sandbox)
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
        self.verified += 1

    async def run(self, stop: asyncio.Event) -> None:
        await self.sandbox.start()
        prompts = asyncio.create_task(self._follow_prompts(stop))
        consumer = Consumer(
            self.log,
            "TRAJECTORIES",
            f"{self.settings.run_id}-rewards",
            self.handle,
            batch=self.settings.concurrency,
            concurrency=self.settings.concurrency,
            fetch_timeout_s=0.5,
        )
        try:
            await consumer.run(stop)
        finally:
            prompts.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await prompts
            await self.sandbox.close()


async def run_rewards(settings: RewardSettings) -> None:
    async def body(event_log: EventLog, stop: asyncio.Event) -> None:
        await RewardWorker(settings, event_log, open_sandbox(settings.sandbox)).run(stop)

    await run_connected(settings, "rewards", body)
