"""The `bwrap` backend: bubblewrap sandboxes, warm and single-use.

Every sandbox runs as its own unprivileged uid (leased for this pool alone, see `uids.py`) in fresh
user, PID, network, IPC and UTS namespaces: no network but its own empty loopback, a read-only
`/usr` and nothing else of the host (no `/root`, no `/etc`, no home, a clean environment), a
private tmpfs as the working directory, rlimits on CPU seconds, address space, processes, file
size and open files, a wall-clock timeout that kills the whole PID namespace, and capped
stdout/stderr.

A warm pool keeps sandboxes started ahead of time (bwrap and the interpreter are already up,
waiting for a program on stdin), sized to the rollout concurrency, so a verification never waits
on start-up. Each sandbox runs one program and is thrown away.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import uuid

from pipeline.logs import get_logger
from pipeline.sandbox import SandboxResult, SandboxSettings, SandboxUnavailable
from pipeline.sandbox.process import RUNNER, ProgramProcess, child_pids, run_program, uid_of
from pipeline.sandbox.uids import UidLease, lease_uids

log = get_logger(__name__)

_PR_SET_CHILD_SUBREAPER = 36


def _binaries(settings: SandboxSettings) -> tuple[str, str]:
    """bwrap and setpriv, resolved now, or SandboxUnavailable naming the Debian package to install."""
    bwrap = shutil.which(settings.bwrap)
    if bwrap is None:
        where = (
            f"no `{settings.bwrap}` on PATH"
            if os.sep not in settings.bwrap
            else f"nothing runnable at {settings.bwrap}"
        )
        raise SandboxUnavailable(
            f"bubblewrap is not installed ({where})",
            hint="install Debian's package: `apt-get install bubblewrap`, or point SPRAWL_SANDBOX__BWRAP at bwrap",
        )
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise SandboxUnavailable("setpriv is not installed", hint="apt-get install util-linux")
    if not settings.python.startswith("/usr/"):
        raise SandboxUnavailable(
            f"sandbox interpreter {settings.python} is not under /usr",
            hint="install Debian's python3 or set SPRAWL_SANDBOX__PYTHON to one under /usr",
        )
    return bwrap, setpriv


def bwrap_argv(settings: SandboxSettings, uid: int) -> list[str]:
    bwrap, setpriv = _binaries(settings)
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        bwrap,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--symlink",
        "usr/bin",
        "/bin",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(settings.tmpfs_mb << 20),
        "--tmpfs",
        "/work",
        "--chdir",
        "/work",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin",
        "--setenv",
        "HOME",
        "/work",
        "--setenv",
        "PYTHONDONTWRITEBYTECODE",
        "1",
        "--",
        settings.python,
        "-I",
        "-S",
        "-c",
        RUNNER,
    ]


class _Warm:
    """One started sandbox waiting for its program."""

    def __init__(self, proc: ProgramProcess, sandbox_id: str, slot: int):
        self.proc, self.sandbox_id, self.slot = proc, sandbox_id, slot


def _become_subreaper() -> bool:
    """Orphaned sandbox processes (bwrap's PID-namespace init, once bwrap has exited) get reparented to
    us instead of to init: we reap them (zombies count against the sandbox uid's process limit) and
    read from them the CPU time the program used."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_orphans(uids: range, keep: set[int]) -> int:
    """Reap zombie children of this process that ran as one of `uids` and are not a sandbox we are
    still waiting on (`keep`): never anyone else's child, whoever else this process started."""
    reaped = 0
    for pid in child_pids():
        if pid in keep or uid_of(pid) not in uids:
            continue
        with contextlib.suppress(ChildProcessError):
            if os.wait4(pid, os.WNOHANG)[0]:
                reaped += 1
    return reaped


class BwrapSandboxPool:
    """Warm, single-use bubblewrap sandboxes; `run` takes one, replaces it in the background."""

    def __init__(self, settings: SandboxSettings):
        self.settings = settings
        _binaries(settings)  # fail now, naming the package, if bubblewrap is missing
        self.slots = max(settings.pool_size, 1) * 2
        self.lease: UidLease | None = None
        self._ready: asyncio.Queue[_Warm] = asyncio.Queue()
        self._free_slots: asyncio.Queue[int] = asyncio.Queue()
        self._spawning: set[asyncio.Task] = set()
        self._live: set[int] = set()
        self._subreaper = False
        self.cold_starts = 0

    @property
    def uids(self) -> range:
        """The uids this pool's sandboxes run as (leased at start, for this pool alone)."""
        assert self.lease is not None, "start() the pool first"
        return self.lease.uids

    async def start(self) -> None:
        """Lease uids, start the warm sandboxes, and run one program: a host where bubblewrap cannot
        start a sandbox (no user namespaces, say) fails here, not as a crash on every reward."""
        s = self.settings
        self.lease = lease_uids(self.slots, uid_base=s.uid_base, uid_span=s.uid_span, lock_dir=s.uid_lock_dir)
        self._subreaper = _become_subreaper()
        for slot in range(self.slots):
            self._free_slots.put_nowait(slot)
        for _ in range(s.pool_size):
            self._refill()
        probe = await self.run("print('ok')")
        if probe.error_class is not None or probe.stdout.strip() != "ok":
            detail = (probe.stderr.strip().splitlines() or [f"exit {probe.exit_code}, signal {probe.signal}"])[-1]
            await self.close()
            raise SandboxUnavailable(
                f"bubblewrap cannot start a sandbox on this host: {detail}",
                hint="run as root (sandboxes switch to their own uids) on a kernel with user namespaces enabled",
            )
        log.info("sandbox pool started", uids=f"{self.lease.first}..{self.lease.first + self.slots - 1}")

    def _refill(self) -> None:
        task = asyncio.create_task(self._spawn_into_pool())
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def _spawn_into_pool(self) -> None:
        try:
            warm = await self._spawn()
        except (OSError, SandboxUnavailable) as exc:  # out of fds, say: the next run starts one cold, or says why
            log.error("could not start a warm sandbox", error=repr(exc))
            return
        await self._ready.put(warm)

    async def _spawn(self) -> _Warm:
        assert self.lease is not None, "start() the pool first"
        slot = await self._free_slots.get()
        uid = self.lease.uid(slot)
        try:
            proc = ProgramProcess.start(
                bwrap_argv(self.settings, uid),
                self.settings,
                env={"PATH": "/usr/bin"},
                helper_uid=uid if self._subreaper else None,
            )
        except BaseException:
            self._free_slots.put_nowait(slot)  # the slot was never used: a failed start must not shrink the pool
            raise
        self._live.add(proc.pid)
        return _Warm(proc, f"bwrap-{uid}-{uuid.uuid4().hex[:8]}", slot)

    async def run(self, program: str) -> SandboxResult:
        try:
            warm = self._ready.get_nowait()
        except asyncio.QueueEmpty:
            self.cold_starts += 1
            warm = await self._spawn()
        else:
            self._refill()
        try:
            return await run_program(warm.proc, warm.sandbox_id, program, self.settings)
        finally:
            await self._discard(warm)

    async def _discard(self, warm: _Warm) -> None:
        await warm.proc.finish()
        self._live.discard(warm.proc.pid)
        assert self.lease is not None
        # Before the slot's uid is reused (its zombies count against NPROC); only this slot's uid, so as
        # not to take another sandbox's helper (and its CPU time) from under it.
        uid = self.lease.uid(warm.slot)
        reap_orphans(range(uid, uid + 1), self._live)
        self._free_slots.put_nowait(warm.slot)

    async def close(self) -> None:
        for task in list(self._spawning):
            task.cancel()
        if self._spawning:
            await asyncio.gather(*self._spawning, return_exceptions=True)
        while not self._ready.empty():
            await self._discard(self._ready.get_nowait())
        if self.lease is not None:
            reap_orphans(self.lease.uids, self._live)
            self.lease.release()
