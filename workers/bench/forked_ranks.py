"""Benchmark workers as forked processes, driven over pipes: two gloo ranks (or one plain process) that
the bench tells what to do next and that answer with what they measured.

Forked, not spawned: the children inherit the imported modules, the model and the compiled codec
kernels, so a round costs no start-up. A child that fails sends its traceback and exits; the parent
raises `BenchWorkerFailed` with it, and ends every child it started (never any other process). A
child whose parent died reads EOF on its pipe and ends.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pipeline.errors import SprawlError

START_TIMEOUT_S = 600.0
"""A worker's answer to one command; generous, as a loaded 2-core machine is slow, but not forever."""


class BenchWorkerFailed(SprawlError):
    """A forked benchmark worker raised, died or did not answer."""


@dataclass
class Worker:
    name: str
    process: multiprocessing.process.BaseProcess
    conn: Connection

    def send(self, message: Any) -> None:
        self.conn.send(message)

    def receive(self, timeout_s: float = START_TIMEOUT_S) -> Any:
        """The worker's next answer; BenchWorkerFailed with its traceback if it failed instead."""
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            if not self.process.is_alive():
                raise self._died()
            if time.monotonic() > deadline:
                raise BenchWorkerFailed(
                    f"benchmark worker {self.name} did not answer in {timeout_s:.1f} s",
                    hint="a rank waiting on its peer's collective: look for the other worker's error",
                )
        try:
            kind, payload = self.conn.recv()
        except EOFError:  # its end of the pipe closed: it exited
            self.process.join(5)
            raise self._died() from None
        if kind == "error":
            raise BenchWorkerFailed(f"benchmark worker {self.name} failed:\n{payload}", hint="a bug in the bench")
        return payload

    def _died(self) -> BenchWorkerFailed:
        return BenchWorkerFailed(
            f"benchmark worker {self.name} exited with code {self.process.exitcode} without answering",
            hint="look for its error on stderr above",
        )


def start_workers(mains: dict[str, Callable[[Connection], None]]) -> list[Worker]:
    """Fork one process per entry; `main(conn)` runs in it and answers with `answer(conn, payload)`."""
    context = multiprocessing.get_context("fork")
    workers = []
    for name, main in mains.items():
        parent, child = context.Pipe()
        process = context.Process(target=_run, args=(main, child), name=f"bench-{name}", daemon=True)
        process.start()
        child.close()
        workers.append(Worker(name, process, parent))
    return workers


def receive_all(workers: list[Worker], timeout_s: float = START_TIMEOUT_S) -> list[Any]:
    """Every worker's next answer, in order. Fails as soon as any of them fails or dies: its peers may be
    waiting in a collective for it, and would only answer when that times out."""
    answers: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(answers) < len(workers):
        for i, worker in enumerate(workers):
            if i not in answers and (worker.conn.poll(0.05) or not worker.process.is_alive()):
                answers[i] = worker.receive(timeout_s=max(0.0, deadline - time.monotonic()))
        if time.monotonic() > deadline and len(answers) < len(workers):
            silent = ", ".join(w.name for i, w in enumerate(workers) if i not in answers)
            raise BenchWorkerFailed(f"benchmark worker(s) {silent} did not answer in {timeout_s:.1f} s")
    return [answers[i] for i in range(len(workers))]


def stop_workers(workers: list[Worker], timeout_s: float = 60.0) -> None:
    """Wait for the workers to exit (they were told to); terminate the ones that do not."""
    deadline = time.monotonic() + timeout_s
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.process.is_alive():
            worker.process.terminate()
            worker.process.join(10)
        worker.conn.close()


def answer(conn: Connection, payload: Any) -> None:
    conn.send(("ok", payload))


def _run(main: Callable[[Connection], None], conn: Connection) -> None:
    # A session of its own, as torchrun starts every rank (start_new_session): where the kernel groups
    # scheduling by session (autogroup), each rank is then weighed as the trainer's ranks would be,
    # not as one group with the bench and its other workers.
    os.setsid()
    try:
        main(conn)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)


def init_gloo(rank: int, world_size: int, store_path: str):
    """Join a gloo process group through a file store, with the trainer's second group for publishing
    (`workers.trainer.distributed.init_ranks` does the same from torchrun's environment)."""
    import torch.distributed as dist

    from workers.trainer.distributed import RankContext

    timeout = datetime.timedelta(seconds=START_TIMEOUT_S)  # a dead peer fails its collectives this late at most
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    publish_group = dist.new_group(backend="gloo", timeout=timeout)
    return RankContext(rank=rank, world_size=world_size, publish_group=publish_group)
