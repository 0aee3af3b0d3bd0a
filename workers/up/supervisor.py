"""Supervised worker processes for `sprawl up`: restart with backoff, stop without leftovers.

Each worker runs in its own session (a terminal's Ctrl-C reaches only the supervisor, which then
stops the workers in order, SIGTERM first so they drain) and with a parent-death signal (if the
supervisor itself is SIGKILLed, the kernel kills the workers too). A worker that exits non-zero is
restarted after an exponential backoff that resets once it has stayed up for a while, and its
restarts and the last line it printed (its one-line error) are shown; one that exits 0 has finished
its job and is left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.logs import get_logger

log = get_logger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class WorkerSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    """What the run's summary says about the worker (e.g. an island's `view`)."""


@dataclass
class Worker:
    spec: WorkerSpec
    log_file: Path
    process: subprocess.Popen | None = None
    restarts: int = 0
    crash_streak: int = 0
    """Crashes in a row, each before the worker had stayed up for `healthy_after_s`."""
    started_at: float = 0.0
    next_start_at: float = 0.0
    backoff_s: float = 0.0
    finished: bool = False
    last_exit: int | None = None
    pids: list[int] = field(default_factory=list)
    """Every pid this worker has had (tests check none is left)."""

    stopped: bool = False
    """Stopped by the supervisor (as opposed to finished by itself)."""
    log_offset: int = 0
    """Where the current process's output begins in `log_file` (appended to across restarts)."""
    last_reason: str | None = None
    """The last line the worker printed before it last exited non-zero: its one-line error."""

    @property
    def state(self) -> str:
        if self.process is not None and self.process.poll() is None:
            return "stopping" if self.stopped else "running"
        if self.stopped:
            return "stopped"
        if self.finished:
            return "finished"
        if self.process is not None and self.process.poll() is None:
            return "running"
        return "backoff"


class Supervisor:
    def __init__(
        self,
        log_dir: Path,
        *,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        healthy_after_s: float = 30.0,
    ):
        self.log_dir = log_dir
        self.backoff_initial_s, self.backoff_max_s, self.healthy_after_s = (
            backoff_initial_s,
            backoff_max_s,
            healthy_after_s,
        )
        self.workers: dict[str, Worker] = {}
        self.events: list[str] = []
        """Human-readable restarts and exits, newest last (the live view shows them)."""

    def add(self, spec: WorkerSpec) -> Worker:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        worker = Worker(spec, self.log_dir / f"{spec.name}.log")
        self.workers[spec.name] = worker
        self._spawn(worker)
        return worker

    def _spawn(self, worker: Worker) -> None:
        out = worker.log_file.open("ab")
        worker.log_offset = out.tell()
        try:
            worker.process = subprocess.Popen(
                worker.spec.argv,
                env=worker.spec.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            out.close()
        worker.pids.append(worker.process.pid)
        worker.started_at = time.monotonic()
        log.info("worker started", worker=worker.spec.name, pid=worker.process.pid, restarts=worker.restarts)

    def poll(self) -> None:
        """Notice exits and restart crashed workers whose backoff has passed. Call it often."""
        now = time.monotonic()
        for worker in self.workers.values():
            if worker.finished:
                continue
            process = worker.process
            if process is not None and process.poll() is not None:
                worker.last_exit = process.returncode
                worker.process = None
                if process.returncode == 0:
                    worker.finished = True
                    self.events.append(f"{worker.spec.name} finished")
                    log.info("worker finished", worker=worker.spec.name)
                    continue
                ran = now - worker.started_at
                worker.crash_streak = 1 if ran >= self.healthy_after_s else worker.crash_streak + 1
                worker.backoff_s = (
                    self.backoff_initial_s
                    if ran >= self.healthy_after_s or worker.backoff_s == 0
                    else min(worker.backoff_s * 2, self.backoff_max_s)
                )
                worker.next_start_at = now + worker.backoff_s
                worker.last_reason = exit_reason(worker.log_file, worker.log_offset)
                self.events.append(
                    f"{worker.spec.name} exited {process.returncode} after {ran:.0f}s"
                    + (f": {worker.last_reason}" if worker.last_reason else "")
                    + f"; restart {worker.restarts + 1} in {worker.backoff_s:.0f}s (see {worker.log_file})"
                )
                log.warning(
                    "worker exited; restarting after backoff",
                    worker=worker.spec.name,
                    exit_code=process.returncode,
                    reason=worker.last_reason,
                    backoff_s=worker.backoff_s,
                    restarts=worker.restarts,
                    log_file=str(worker.log_file),
                )
            if worker.process is None and now >= worker.next_start_at:
                worker.restarts += 1
                self._spawn(worker)

    def stop(self, names: list[str] | None = None, *, grace_s: float = 15.0) -> None:
        """SIGTERM (the workers drain), then SIGKILL whatever is still there after `grace_s`."""
        chosen = [self.workers[n] for n in (names or list(self.workers))]
        for worker in chosen:
            if not worker.finished:
                worker.stopped = True
            worker.finished = True  # no restarts from here on
            if worker.process is not None and worker.process.poll() is None:
                _signal_group(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for worker in chosen:
            if worker.process is None:
                continue
            try:
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker did not stop in time; killing it", worker=worker.spec.name)
                _signal_group(worker.process.pid, signal.SIGKILL)
                worker.process.wait()
            # The worker's own children (e.g. sandbox helpers) share its process group.
            _signal_group(worker.process.pid, signal.SIGKILL)

    def kill_all(self) -> None:
        """SIGKILL every worker's process group now, and restart none (a second Ctrl-C: no draining).
        Safe to call while `stop` waits in another thread: it only sends signals."""
        for worker in self.workers.values():
            worker.finished = True
            process = worker.process
            if process is not None and process.poll() is None:
                worker.stopped = True
                _signal_group(process.pid, signal.SIGKILL)

    def alive_pids(self) -> list[int]:
        return [pid for w in self.workers.values() for pid in w.pids if _alive(pid)]


_REASON_TAIL_BYTES = 16 * 1024
_REASON_MAX_CHARS = 240


def exit_reason(log_file: Path, offset: int) -> str | None:
    """The one line that says why a worker exited: the last line it printed since `offset` (a worker
    ends with `sprawl: error: ...`, a traceback with its exception), shortened; a structlog JSON line
    as its event and error. None when it printed nothing."""
    try:
        with log_file.open("rb") as out:
            out.seek(max(offset, out.seek(0, os.SEEK_END) - _REASON_TAIL_BYTES))
            tail = out.read().decode(errors="replace")
    except OSError:
        return None
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    if not lines:
        return None
    line = lines[-1]
    if line.startswith("{"):
        with contextlib.suppress(ValueError, AttributeError):
            record = json.loads(line)
            line = " ".join(str(record[k]) for k in ("event", "error", "exception") if record.get(k))
    line = " ".join(line.split())
    return line if len(line) <= _REASON_MAX_CHARS else line[: _REASON_MAX_CHARS - 1] + "…"


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A reaped child's pid can be reused, but a zombie we have not reaped still answers: check.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
