"""How `sprawl up` is stopped: by SIGINT (Ctrl-C), SIGTERM or SIGHUP, at any phase, within seconds.

The first signal stops the run: in the synchronous start (the stack) it raises `Stopped` where the
main thread is; once the event loop runs, it sets an event that every phase races against
(`until_stopped`), and the phase's work is cancelled (the warm-up child is stopped, a connection
attempt abandoned). Whatever had started is then stopped in order. A second signal while stopping
hurries it (the workers are SIGKILLed instead of drained); later ones are ignored. The exit code is
128 + the signal's number (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP), as a shell reports a
process killed by it, with one "stopped" line instead of a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from pipeline.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

CANCEL_GRACE_S = 15.0
"""How long a cancelled phase may take to clean up (the warm-up child: SIGTERM, 5 s, SIGKILL)."""


class Stopped(KeyboardInterrupt):
    """`sprawl up` was stopped by a signal during `phase`. A KeyboardInterrupt, so that nothing on the
    way out mistakes it for an error to handle."""

    def __init__(self, signum: int, phase: str = ""):
        super().__init__(signum, phase)
        self.signum, self.phase = signum, phase

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


def exit_code(signum: int) -> int:
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """The stop signals of one `sprawl up`: the first one and what to do about later ones."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.event = asyncio.Event()
        self.on_again: list[Callable[[], None]] = []
        """Called at a second signal: hurry the stop."""

    @property
    def stopped(self) -> bool:
        return self.signum is not None

    def _notice(self, signum: int) -> bool:
        """Record a signal; True if it is the first."""
        if self.signum is None:
            self.signum = signum
            log.warning("stop signal", signal=signal_name(signum))
            return True
        log.warning("stop signal again: hurrying", signal=signal_name(signum))
        for hurry in self.on_again:
            hurry()
        return False

    @contextlib.contextmanager
    def raising(self, phase: Callable[[], str]) -> Iterator[None]:
        """While synchronous code runs: the first signal raises `Stopped` in the main thread (during
        `phase()`); later ones only hurry."""

        def handler(signum, frame) -> None:
            if self._notice(signum):
                raise Stopped(signum, phase())

        previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    @contextlib.contextmanager
    def ignoring(self) -> Iterator[None]:
        """While cleaning up after a stop (bounded work): signals only hurry, nothing is cut half-way."""

        def handler(signum, frame) -> None:
            self._notice(signum)

        previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def watch(self) -> None:
        """In the event loop: signals set `event` (and a first one that came earlier is kept)."""
        loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        if self.signum is not None:
            self.event.set()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._in_loop, sig)

    def _in_loop(self, signum: int) -> None:
        if self._notice(signum):
            self.event.set()

    async def until_stopped(self, work: Awaitable[T], phase: str) -> T:
        """`work`'s result, unless a stop signal comes first: then `work` is cancelled (given
        CANCEL_GRACE_S to clean up) and `Stopped` raised."""
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(self.event.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        if not task.done():
            log.warning("a stopped phase did not finish cleaning up in time", phase=phase)
        elif not task.cancelled() and task.exception() is not None:
            log.warning("a stopped phase failed while cancelled", phase=phase, error=repr(task.exception()))
        assert self.signum is not None  # the waiter only finishes when a signal was noticed
        raise Stopped(self.signum, phase)
