"""Publishing off the trainer's critical path: the update for step n+1 runs while version n is viewed,
encoded, uploaded and appended.

The update mutates the model in place, so the loop first captures version n's weights: a copy into
one of `depth` reusable snapshots (a plain tensor copy, far cheaper than computing the views, which
quantize). The snapshot goes into a queue that one background task publishes from, strictly in
order, one version at a time, and the snapshot returns to the pool once its version is appended.

Back-pressure: with every snapshot in use (`depth` versions captured and not yet appended) the loop
waits for one to come back; that wait, the capture itself and any `drain` are the time the update
loop was blocked on publishing, summed in `blocked_s` and handed to each version's publish.

A publish that fails ends the background task with PublishFailed naming the version; the trainer
runs it as a guard, so the trainer stops at once, loudly, with no version after the failed one
appended and none skipped. Fails means after the log's own append retries, and after an unavailable
blob store was waited out for `blobs.outage_patience_s` (pipeline/blobstore/outage.py): meanwhile
the version waits in the queue, and the update loop runs on until the queue is full.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from pipeline.errors import SprawlError, WorkerPartFailed
from pipeline.logs import get_logger

log = get_logger(__name__)

Job = TypeVar("Job")


class PublishFailed(SprawlError):
    """A version could not be published: the trainer stops rather than skip it."""

    def __init__(self, version: int, cause: BaseException):
        self.version = version
        detail = cause.message if isinstance(cause, SprawlError) else f"{type(cause).__name__}: {cause}"
        super().__init__(
            f"publishing policy version {version} failed: {detail}",
            hint="the trainer stopped rather than skip a version (none after it was appended); "
            "a restart resumes from the chain's head"
            + (f"; {cause.hint}" if isinstance(cause, SprawlError) and cause.hint else ""),
        )


@dataclass
class Pending(Generic[Job]):
    """One captured version waiting to be published."""

    version: int
    weights: dict[str, torch.Tensor]
    """The snapshot: the model's state dict as it was when the version was captured."""
    job: Job
    """What the publish needs besides the weights (the trainer: its batch, step and metrics)."""
    blocked_s: float
    """How long the update loop was blocked on publishing since the previous version was captured
    (waits for a free snapshot, drains, the capture itself)."""


def copy_weights(buffer: dict[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy `state_dict` into `buffer`, reusing its tensors (allocated on first use, on the same device).

    Entries that alias one another (tied embeddings) are copied once and stay aliased in the copy, so
    the views see exactly what they would have seen in the model."""
    copies: dict[tuple, torch.Tensor] = {}
    written: set[int] = set()  # storages filled by this capture: never overwritten by another entry
    with torch.no_grad():
        for name, tensor in state_dict.items():
            alias = (
                tensor.device,
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tensor.dtype,
                tuple(tensor.shape),
                tuple(tensor.stride()),
            )
            if alias not in copies:
                target = buffer.get(name)
                reusable = (
                    target is not None
                    and (target.shape, target.dtype, target.device) == (tensor.shape, tensor.dtype, tensor.device)
                    and target.untyped_storage().data_ptr() not in written
                )
                if not reusable:
                    target = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                _copy(target, tensor.detach())
                written.add(target.untyped_storage().data_ptr())
                copies[alias] = target
            buffer[name] = copies[alias]
    for stale in [n for n in buffer if n not in state_dict]:
        del buffer[stale]


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """`target[...] = source`. On the CPU a plain memcpy of the bytes (numpy, one thread, the GIL
    released): torch's copy goes through its intra-op thread pool, and on a busy machine waiting for
    that pool per tensor cost 50x the copy itself (`sprawl bench trainer`: capture_s)."""
    if source.device.type == "cpu" and source.is_contiguous() and target.is_contiguous() and source.numel():
        np.copyto(target.view(-1).view(torch.uint8).numpy(), source.reshape(-1).view(torch.uint8).numpy())
    else:
        target.copy_(source)  # on an accelerator: queued on the device's stream, before the next update


class BackgroundPublisher(Generic[Job]):
    """Versions captured by `submit`, published in order by `run` (a task that lives as long as the
    trainer), at most `depth` of them captured and not yet appended."""

    def __init__(
        self,
        publish: Callable[[Pending[Job]], Awaitable[None]],
        depth: int,
        name: str,
        while_waiting: Callable[[], Awaitable[None]] | None = None,
        while_waiting_every_s: float = 1.0,
    ):
        """`name`: the part's name in errors, and the name of the task `start` makes. `while_waiting`:
        called every `while_waiting_every_s` while the caller is blocked (a trainer of several ranks
        tells the others it is alive: a store outage can block it for minutes)."""
        if depth < 1:
            raise ValueError("depth must be at least 1")
        self._publish = publish
        self._while_waiting = while_waiting
        self._while_waiting_every_s = while_waiting_every_s
        self.name = name
        self.depth = depth
        self._free: asyncio.Queue[dict[str, torch.Tensor]] = asyncio.Queue()
        for _ in range(depth):
            self._free.put_nowait({})
        self._pending: asyncio.Queue[Pending[Job]] = asyncio.Queue()
        """Unbounded as a queue, bounded by the snapshots: nothing enters it without one."""
        self._progress = asyncio.Condition()
        self.submitted: int | None = None
        """The newest version captured."""
        self.published: int | None = None
        """The newest version whose publish completed."""
        self.failure: PublishFailed | None = None
        self.blocked_s = 0.0
        """Total time `submit` and `drain` kept their caller waiting."""
        self.waiting = False
        """The caller is blocked right now (no free snapshot, or draining): what back-pressure looks like."""
        self._blocked_since_submit = 0.0

    # ---------------------------------------------------------------- the update loop's side

    async def submit(self, version: int, state_dict: Mapping[str, torch.Tensor], job: Job) -> float:
        """Capture `version`'s weights and queue it; returns how long this call blocked. Waits only for a
        free snapshot (back-pressure: `depth` versions are in flight)."""
        if self.submitted is not None and version != self.submitted + 1:
            raise ValueError(f"version {version} submitted after {self.submitted}: versions are consecutive")
        self._raise_if_failed()
        started = time.perf_counter()
        buffer = await self._wait(self._free.get(), version, "the publish queue is full: the update waits")
        await asyncio.to_thread(copy_weights, buffer, state_dict)
        blocked = time.perf_counter() - started
        self._count_blocked(blocked)
        pending = Pending(version, buffer, job, self._blocked_since_submit)
        self._blocked_since_submit = 0.0
        self.submitted = version
        self._pending.put_nowait(pending)
        return blocked

    async def drain(self, through: int | None = None) -> float:
        """Wait until every version submitted (or every one up to `through`) is published; returns the
        time waited. Raises WorkerPartFailed if the background task failed first."""
        target = self.submitted if through is None else through
        if target is None:
            return 0.0

        def reached() -> bool:
            return self.failure is not None or (self.published is not None and self.published >= target)

        async def progress() -> None:
            async with self._progress:
                await self._progress.wait_for(reached)

        started = time.perf_counter()
        await self._wait(progress(), target, "waiting for the publisher to catch up")
        waited = time.perf_counter() - started
        self._count_blocked(waited)
        self._raise_if_failed()
        return waited

    def _raise_if_failed(self) -> None:
        # The same error the guard that runs `run` raises: whichever of the two the trainer sees first.
        if self.failure is not None:
            raise WorkerPartFailed(self.name, self.failure) from self.failure

    async def _wait(self, awaitable: Awaitable, version: int, why: str):
        """Await `awaitable` with `waiting` set (what back-pressure looks like from outside), logging a
        wait that was not instant."""
        started = time.perf_counter()
        self.waiting = True
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                await asyncio.wait({task}, timeout=self._while_waiting_every_s if self._while_waiting else None)
                if task.done():
                    return task.result()
                assert self._while_waiting is not None
                await self._while_waiting()
        finally:
            task.cancel()  # the caller was cancelled (a no-op once it is done)
            self.waiting = False
            waited = time.perf_counter() - started
            if waited > 0.001:
                log.info(why, version=version, waited_s=round(waited, 4), depth=self.depth)

    def _count_blocked(self, seconds: float) -> None:
        self.blocked_s += seconds
        self._blocked_since_submit += seconds

    # ---------------------------------------------------------------- the background task

    def start(self) -> asyncio.Task:
        """The background task, named after the part (a guard of whoever runs the update loop)."""
        return asyncio.create_task(self.run(), name=self.name)

    async def run(self) -> None:
        """Publish queued versions in order until cancelled; a failed publish ends it with PublishFailed."""
        while True:
            pending = await self._pending.get()
            try:
                await self._publish(pending)
            except Exception as exc:
                self.failure = PublishFailed(pending.version, exc)
                async with self._progress:
                    self._progress.notify_all()
                log.error("policy version not published: the trainer stops", version=pending.version, error=str(exc))
                raise self.failure from exc
            async with self._progress:
                self.published = pending.version
                self._progress.notify_all()
            self._free.put_nowait(pending.weights)
