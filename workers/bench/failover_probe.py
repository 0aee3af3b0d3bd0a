"""A steady stream of appends and a consumer applying them, for measuring what a fault does to the log.

The producer appends prompt groups (the stream the samplers' shared consumer reads, the one KEDA scales
islands on) one after another, as a sampler fleet's driver would: an append that fails (the log is
electing a leader, the blob store is down under a claim check) is appended again with the same id,
and each append the log acknowledged is remembered with when it was acknowledged. The consumer is the
run's declared samplers consumer, bound through `pipeline.consumer.Consumer` exactly as an island binds
it, and counts how many times its handler ran for each event.

From that: `seconds_without_appends` (the longest wait between two acknowledged appends), `lost` (acked
events that are not in the stream or never reached the consumer), `stored_twice` (an event id stored
at two stream positions) and `applied_twice` (a handler run twice for one event).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

import nats.errors

from pipeline.consumer import Consumer, Delivery
from pipeline.errors import SprawlError
from pipeline.eventlog import NO_ANSWER, EventLog
from pipeline.logs import get_logger
from pipeline.topology import PROMPTS, ConsumerRole, consumer_for
from schemas import PromptGroup, SamplingParams
from workers.bench.faults.fleet import LOG_TROUBLE
from workers.bench.faults.ledger import scan_stream

log = get_logger(__name__)


class FaultNeverHealed(SprawlError):
    """What the probe awaited (appends resuming, a consumer catching up) did not happen within its guard."""


@dataclass
class ProbeOutcome:
    seconds_without_appends: float
    lost: int
    applied_twice: int
    stored_twice: int
    appended: int
    applied: int
    retried_appends: int
    """Appends that failed while the fault was on and were made again (same id)."""
    baseline_max_gap_s: float
    """The longest wait between two acknowledged appends before the fault: the same run's baseline."""
    down_s: float | None = None
    """For an outage: how long the service was down, from stopping it to healthy again."""

    def summary(self) -> dict:
        return {
            "seconds_without_appends": round(self.seconds_without_appends, 3),
            "lost": self.lost,
            "applied_twice": self.applied_twice,
            "stored_twice": self.stored_twice,
            "appended": self.appended,
            "applied": self.applied,
            "retried_appends": self.retried_appends,
            "baseline_max_gap_s": round(self.baseline_max_gap_s, 3),
            **({"down_s": round(self.down_s, 3)} if self.down_s is not None else {}),
        }


def probe_group(run_id: str, index: int, pad_bytes: int = 0) -> PromptGroup:
    """The `index`-th probe event; `pad_bytes` makes it large enough to go through a claim check."""
    return PromptGroup(
        run_id=run_id,
        group_id=f"probe{index:07d}",
        task="failover-probe",
        prompt=f"probe {index}",
        prompt_token_ids=[1, 2, 3],
        n_samples=1,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=1),
        answer=str(index),
        metadata={"pad": "x" * pad_bytes} if pad_bytes else {},
    )


async def scan_patiently(event_log: EventLog, run_id: str, guard_s: float) -> list:
    """Every probe event stored for `run_id`, in order. Right after a leader change the JetStream API
    may not answer the scan's consumer requests for a while (the cluster settling): asked again until
    `guard_s` runs out, then the last error is raised."""
    deadline = time.monotonic() + guard_s
    while True:
        try:
            return await scan_stream(event_log, PROMPTS, run_id)
        except (*NO_ANSWER, nats.errors.Error) as exc:
            if time.monotonic() > deadline:
                raise
            log.info("stream scan waits for the cluster", error=repr(exc)[:200])
            await asyncio.sleep(1.0)


@dataclass
class AppendProbe:
    producer: EventLog
    consumer_log: EventLog
    run_id: str
    pad_bytes: int = 0
    pace_s: float = 0.02
    """Pause between appends: a steady rate, not a flood that would measure the 2-core machine instead."""
    acked_at: dict[str, float] = field(default_factory=dict)
    """Event id -> when its append was acknowledged (monotonic)."""
    applied: Counter = field(default_factory=Counter)
    retried: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _stop_producing: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _acks: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def start(self) -> None:
        durable = consumer_for(self.run_id, ConsumerRole.SAMPLERS).name
        consumer = Consumer(self.consumer_log, PROMPTS.name, durable, self._apply, batch=64, fetch_timeout_s=0.5)
        await consumer.bind()
        self._tasks = [asyncio.create_task(self._produce()), asyncio.create_task(consumer.run(self._stop))]

    async def stop_appending(self) -> None:
        self._stop_producing.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._tasks[0]

    async def stop(self) -> None:
        self._stop_producing.set()
        self._stop.set()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _apply(self, delivery: Delivery) -> None:
        self.applied[delivery.event.event_id] += 1

    async def _produce(self) -> None:
        index = 0
        while not self._stop_producing.is_set():
            event = probe_group(self.run_id, index, self.pad_bytes)
            while not self._stop_producing.is_set():
                try:
                    await self.producer.append(event)
                    break
                except LOG_TROUBLE as exc:  # the same event (same id) again, as a real driver would
                    self.retried += 1
                    log.info("probe append waits", error=repr(exc)[:200], index=index)
                    await asyncio.sleep(0.2)
            else:
                return
            async with self._acks:
                self.acked_at[event.event_id] = time.monotonic()
                self._acks.notify_all()
            index += 1
            await asyncio.sleep(self.pace_s)

    async def wait_acks(self, count: int, *, after: float = 0.0, guard_s: float, what: str) -> None:
        """Wait until `count` appends were acknowledged after monotonic time `after`."""

        def enough() -> bool:
            return sum(1 for t in self.acked_at.values() if t > after) >= count

        async with self._acks:
            try:
                await asyncio.wait_for(self._acks.wait_for(enough), guard_s)
            except TimeoutError:
                raise FaultNeverHealed(
                    f"{what}: fewer than {count} appends acknowledged within {guard_s:.0f}s",
                    hint="the log did not recover from the fault; see the servers' logs",
                ) from None

    async def wait_applied(self, guard_s: float) -> None:
        """Wait until the consumer applied every acknowledged event (or the guard runs out: then they
        count as lost)."""
        deadline = time.monotonic() + guard_s
        while set(self.acked_at) - set(self.applied) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def outcome(self, fault_at: float, guard_s: float = 180.0) -> ProbeOutcome:
        """What happened, the fault having started at monotonic time `fault_at`."""
        stored = await scan_patiently(self.producer, self.run_id, guard_s)
        positions = Counter(m.event.event_id for m in stored if m.event is not None)
        times = sorted(self.acked_at.values())
        gaps = [b - a for a, b in itertools.pairwise(times)]
        before = [b - a for a, b in itertools.pairwise(times) if b < fault_at]
        missing_in_stream = {e for e in self.acked_at if positions[e] == 0}
        never_applied = set(self.acked_at) - set(self.applied)
        return ProbeOutcome(
            seconds_without_appends=max(gaps, default=0.0),
            lost=len(missing_in_stream | never_applied),
            applied_twice=sum(1 for n in self.applied.values() if n > 1),
            stored_twice=sum(1 for n in positions.values() if n > 1),
            appended=len(self.acked_at),
            applied=len(self.applied),
            retried_appends=self.retried,
            baseline_max_gap_s=max(before, default=0.0),
        )
