"""One program in one process: start it under rlimits, feed it, read it with caps, and say how it ended.

How a program ended is decided from what happened to the process, never from a clock reading:
its exit status and the CPU time the kernel accounted to it (`wait4`'s rusage, which covers every
descendant that was reaped: inside bubblewrap, all of them), plus whether we killed it and why.
The wall clock only decides *when* we kill a program that is still running. That is why the
process is reaped here (through a pidfd) rather than by asyncio's child watcher: the watcher
throws the rusage away, and its exit notice can arrive after the deadline for a program that had
long been stopped by its CPU limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Container, Iterable

from pipeline.sandbox import SandboxResult, SandboxSettings

# Reads the program from stdin, then runs it as __main__: everything before is start-up paid in the pool.
# sys.argv[1] is the number of the program's result channel (see `ProgramProcess`).
RUNNER = "import sys; _src = sys.stdin.read(); exec(compile(_src, '<sandbox>', 'exec'), {'__name__': '__main__'})"

_DRAIN_S = 5.0
"""After the program has ended, how long its pipes may take to reach EOF (a bound, not a verdict)."""


def _limits(settings: SandboxSettings, before_exec: Callable[[], None] | None):
    def apply() -> None:  # runs in the child between fork and exec
        os.setsid()  # its own process group: a kill takes the group
        if before_exec is not None:
            before_exec()
        resource.setrlimit(resource.RLIMIT_CPU, (settings.cpu_seconds, settings.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (settings.memory_mb << 20, settings.memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_NPROC, (settings.max_processes, settings.max_processes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (settings.max_file_mb << 20, settings.max_file_mb << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (settings.max_open_files, settings.max_open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


_AWAITED: set[int] = set()
"""Children a `ProgramProcess` (or its helper reaping) is waiting for: `reap_orphans` leaves them
alone, so their owner reads their real exit status and CPU time, never a "someone else reaped it"."""
_HELPERS_AWAITED: set[int] = set()
"""uids of `ProgramProcess`es whose helpers are not reaped yet: a helper becomes our child (and
may end) before its owner looks for it, and the program's CPU time is in its exit status."""


def reap_orphans(uids: Container[int]) -> int:
    """Reap ended children of this process that ran as one of `uids` and that nobody here waits for
    (a sandbox's helpers whose owner gave up on them, or the processes of a sandbox killed as a
    whole): zombies count against their uid's process limit and keep it from looking clean."""
    reaped = 0
    for pid in child_pids():
        uid = uid_of(pid)
        if pid in _AWAITED or uid in _HELPERS_AWAITED or uid not in uids:
            continue
        with contextlib.suppress(ChildProcessError):
            if os.wait4(pid, os.WNOHANG)[0]:
                reaped += 1
    return reaped


def child_pids() -> list[int]:
    """This process's children (the helpers of exited sandboxes are reparented to one of its threads)."""
    pids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/self/task/{task}/children") as children:
            pids.extend(int(pid) for pid in children.read().split())
    return pids


def processes_of(uids: Container[int]) -> list[int]:
    """Every live process on this host, as far as /proc shows, that runs as one of `uids`: its real,
    effective, saved or filesystem uid is one of them. Zombies are left out: they run nothing, hold
    nothing but a pid, and one whose parent is not us (a dead pool's, reparented to an init that
    reaps when it likes) is beyond anyone's reach here; our own are reaped by `reap_orphans`."""
    pids = (int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit())
    return [pid for pid in pids if _runs_as(pid, uids)]


def _status(pid: int) -> tuple[str, list[int]] | None:
    """A process's state letter and its real, effective, saved and filesystem uids (None: it is gone)."""
    state, uids = "", []
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("State:"):
                    state = line.split()[1]
                elif line.startswith("Uid:"):
                    uids = [int(uid) for uid in line.split()[1:]]
                    break
    except (FileNotFoundError, ProcessLookupError):
        return None
    return state, uids


def _runs_as(pid: int, uids: Container[int]) -> bool:
    """`pid` is alive, not a zombie, and one of its uids is one of `uids`."""
    status = _status(pid)
    return status is not None and status[0] not in ("Z", "X") and any(uid in uids for uid in status[1])


async def kill_processes_of(uid: int, patience_s: float) -> list[int]:
    """SIGKILL every process running as `uid` and wait until all have ended (the kernel frees them at
    once unless one is stuck in the kernel); returns those still there after `patience_s`. Each is
    signalled through a pidfd opened while it still runs as `uid`, so a pid reused meanwhile by
    someone else's process is never hit."""
    give_up = time.monotonic() + patience_s
    while True:
        reap_orphans((uid,))  # our own children among them end as zombies until reaped
        pids = processes_of((uid,))
        if not pids:
            return []
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except (ProcessLookupError, OSError):
                continue
            try:
                if _runs_as(pid, (uid,)):  # still the process we found, not a reuse of its pid
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            finally:
                os.close(pidfd)
        if time.monotonic() >= give_up:
            return pids
        await asyncio.sleep(0.01)


def uid_of(pid: int) -> int | None:
    """A process's real uid (None: it is gone)."""
    status = _status(pid)
    return status[1][0] if status is not None and status[1] else None


async def _reap_child(pid: int) -> float:
    """SIGKILL a child, reap it, and return its CPU seconds (its reaped descendants included)."""
    pidfd = None
    with contextlib.suppress(OSError, AttributeError):
        pidfd = os.pidfd_open(pid)
    _AWAITED.add(pid)
    try:
        # Not reaped yet, so the pid is still this child's: the signal cannot reach anyone else.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while True:
            reaped, _, usage = os.wait4(pid, os.WNOHANG)
            if reaped:
                return usage.ru_utime + usage.ru_stime
            if pidfd is not None:
                await _ready(pidfd)
            else:
                await asyncio.sleep(0.005)
    except ChildProcessError:  # reaped by someone else meanwhile
        return 0.0
    finally:
        _AWAITED.discard(pid)
        if pidfd is not None:
            os.close(pidfd)


async def _ready(fd: int, *, write: bool = False) -> None:
    """Wait until `fd` is readable (or writable): pipes and pidfds alike."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        remove(fd)


class ProgramProcess:
    """A started process (bwrap, or the interpreter itself) waiting for its program on stdin.

    Besides stdout and stderr, which the program shares with whatever code it runs, it gets a private
    result channel: the write end of a pipe whose number is its last argument (`sys.argv[1]` for the
    runner). A program that runs untrusted code closes it first (see the `code_tests` harness), so
    what arrives on it was written by trusted code; the host reads it into `SandboxResult.channel`."""

    def __init__(self, popen: subprocess.Popen, channel: int, helper_uid: int | None = None):
        assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
        self.popen = popen
        self.pid = popen.pid
        _AWAITED.add(self.pid)
        self.channel = channel
        self.helper_uid = helper_uid
        if helper_uid is not None:
            _HELPERS_AWAITED.add(helper_uid)
        self._exit: tuple[int, float] | None = None  # (wait status, CPU seconds)
        self._helpers_reaped = helper_uid is None
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):  # no pidfds (kernel < 5.3): poll instead
            self._pidfd = os.pidfd_open(self.pid)
        for fd in (popen.stdin.fileno(), popen.stdout.fileno(), popen.stderr.fileno(), channel):
            os.set_blocking(fd, False)

    @classmethod
    def start(
        cls,
        argv: list[str],
        settings: SandboxSettings,
        env: dict[str, str],
        *,
        helper_uid: int | None = None,
        pass_fds: Iterable[int] = (),
        before_exec: Callable[[], None] | None = None,
    ) -> ProgramProcess:
        """`helper_uid`: the process leaves helpers running as this uid that become our children when it
        exits (bubblewrap's PID-namespace init, with this process a child subreaper): they are reaped
        here, and the CPU time they had reaped (the program's) is counted. `pass_fds`: more descriptors
        it inherits (bubblewrap's seccomp program). `before_exec`: runs in the child between fork and
        exec, as this process's user (joining the sandbox's cgroup)."""
        channel, channel_end = os.pipe2(os.O_CLOEXEC)
        try:
            popen = subprocess.Popen(
                [*argv, str(channel_end)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=_limits(settings, before_exec),
                env=env,
                pass_fds=(channel_end, *pass_fds),
            )
        except BaseException:
            os.close(channel)
            raise
        finally:
            os.close(channel_end)  # the program holds the only write end: EOF when it (and its children) end
        return cls(popen, channel, helper_uid)

    @property
    def exited(self) -> bool:
        return self._exit is not None

    def poll(self) -> bool:
        """Reap the process if it has ended (recording its status and CPU time); True once it has."""
        if self._exit is not None:
            return True
        try:
            if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return False
            # Ended but not reaped yet, so its group id cannot have been reused: kill what is left of the
            # group (the unsandboxed runner's stragglers), then reap it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            _, status, usage = os.wait4(self.pid, 0)
            cpu = usage.ru_utime + usage.ru_stime
        except ChildProcessError:  # someone else reaped it: the status is lost, call it a crash
            status, cpu = 1 << 8, 0.0
        self._exit = (status, cpu)
        _AWAITED.discard(self.pid)
        self.popen.returncode = os.waitstatus_to_exitcode(status)  # so Popen never tries to reap it again
        return True

    async def wait(self) -> tuple[int, float]:
        """The wait status and CPU seconds, once the process (and its helpers) have ended."""
        while not self.poll():
            if self._pidfd is not None:
                await _ready(self._pidfd)
            else:
                await asyncio.sleep(0.02)
        if not self._helpers_reaped:
            status, cpu = self._exit
            try:
                self._exit = (status, cpu + await self._reap_helpers())
            finally:
                self._helpers_reaped = True
                _HELPERS_AWAITED.discard(self.helper_uid)
        assert self._exit is not None
        return self._exit

    async def _reap_helpers(self) -> float:
        """Kill and reap our children running as `helper_uid` (reparented to us when the process exited);
        returns the CPU time they account for, their reaped descendants included. Killed, not waited
        for: bwrap sets its init's parent-death signal only after `clone`, so a sandbox killed right
        as it starts can leave an init that would otherwise live on."""
        cpu = 0.0
        with contextlib.suppress(TimeoutError):  # give up: reap_orphans collects it before the uid is reused
            async with asyncio.timeout(_DRAIN_S):
                while helpers := [pid for pid in child_pids() if uid_of(pid) == self.helper_uid]:
                    for pid in helpers:
                        cpu += await _reap_child(pid)
        return cpu

    def kill(self) -> None:
        """SIGKILL the process group (bwrap's death takes its whole PID namespace with it)."""
        if self._exit is not None:
            return  # reaped: the pid and group may belong to someone else by now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    async def finish(self) -> None:
        """Kill whatever is left, reap it and close our ends of the pipes."""
        self.kill()
        try:
            await self.wait()
        finally:  # even if cancelled: whatever is left of the uid is reaped by whoever cleans it
            _HELPERS_AWAITED.discard(self.helper_uid)
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self.channel >= 0:
            os.close(self.channel)
            self.channel = -1
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    async def feed(self, data: bytes) -> None:
        """Write the program to stdin and close it (the runner reads to EOF before it starts)."""
        assert self.popen.stdin is not None
        fd, view = self.popen.stdin.fileno(), memoryview(data)
        try:
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    await _ready(fd, write=True)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died before reading everything: its exit status says why
        finally:
            self.popen.stdin.close()

    async def read_capped(self, which: str, limit: int, into: bytearray) -> bool:
        """stdout, stderr or the result channel into `into` until EOF (False), or until it passes
        `limit` bytes (True). `into` keeps what was read even if the reader is cancelled."""
        streams = {"stdout": self.popen.stdout, "stderr": self.popen.stderr}
        fd = self.channel if which == "channel" else streams[which].fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                await _ready(fd)
                continue
            if not chunk:
                return False
            into += chunk[: limit + 1 - len(into)]
            if len(into) > limit:
                del into[limit:]
                return True


async def run_program(proc: ProgramProcess, sandbox_id: str, program: str, settings: SandboxSettings) -> SandboxResult:
    """Feed `program` to a started process and collect how it ended; the caller `finish()`es it."""
    started = time.monotonic()
    deadline = started + settings.wall_timeout_s
    stdout, stderr, channel = bytearray(), bytearray(), bytearray()
    feeding = asyncio.create_task(proc.feed(program.encode()))
    out = asyncio.create_task(proc.read_capped("stdout", settings.max_output_bytes, stdout))
    err = asyncio.create_task(proc.read_capped("stderr", settings.max_output_bytes, stderr))
    result = asyncio.create_task(proc.read_capped("channel", settings.max_result_bytes, channel))
    exited = asyncio.create_task(proc.wait())
    timed_out = truncated = False
    try:
        pending: set[asyncio.Task] = {out, err, result, exited}
        while not exited.done():
            done, pending = await asyncio.wait(
                pending, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
            )
            if any(t in done and t.result() for t in (out, err, result)):
                truncated = True
                break
            # Past the deadline it is a timeout only if it is really still running: on a loaded machine
            # the exit of a program stopped by its CPU limit can be noticed after the deadline.
            if exited not in done and time.monotonic() >= deadline and not proc.poll():
                timed_out = True
                break
        if timed_out or truncated:
            proc.kill()
        status, cpu = await exited
        # Ended: its output is what reached the pipes. Bounded, though EOF follows at once in bubblewrap
        # (the PID namespace dies with the sandbox).
        await asyncio.wait({out, err, result}, timeout=_DRAIN_S)
    finally:
        tasks = (feeding, out, err, result, exited)
        for task in tasks:
            task.cancel()
        # Let them unregister their descriptors before the caller closes them.
        await asyncio.gather(*tasks, return_exceptions=True)
    code = os.waitstatus_to_exitcode(status)
    # bwrap reports a program killed by signal N as exit status 128 + N.
    sig = -code if code < 0 else (code - 128 if code > 128 else None)
    exit_code = code if 0 <= code <= 128 else None
    # Stopped by RLIMIT_CPU: SIGXCPU at the soft limit, or (SIGXCPU ignored) SIGKILL at the hard one,
    # told from any other SIGKILL by the CPU time it had used. Not when we killed it ourselves.
    cpu_limited = not (timed_out or truncated) and (
        sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= settings.cpu_seconds)
    )
    return SandboxResult(
        sandbox_id=sandbox_id,
        exit_code=exit_code,
        signal=sig,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
        channel=bytes(channel),
        duration_s=time.monotonic() - started,
        timed_out=timed_out,
        output_truncated=truncated,
        cpu_limited=cpu_limited,
        cpu_seconds=cpu,
    )
