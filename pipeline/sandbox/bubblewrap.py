"""The `bwrap` backend: bubblewrap sandboxes, warm and single-use, each one a cgroup, not a process.

Every sandbox runs as its own unprivileged uid (leased for this pool alone, see `uids.py`) in fresh
user, PID, network, IPC and UTS namespaces: no network but its own empty loopback, a read-only
`/usr` and nothing else of the host (no `/root`, no `/etc`, no home, a clean environment), a
read-only root and `/dev`, and one fresh scratch tmpfs capped in bytes and inodes for `/work`,
`/tmp` and `/dev/shm` (`scratch.py`). Around it:

- its own cgroup (`cgroups.py`): memory (every process, tmpfs and memfd pages), pids and CPU
  bandwidth for the sandbox as a whole, and the means to kill all of it at once;
- a seccomp filter (`syscall_filter.py`): no ptrace, keyrings, io_uring, userfaultfd, perf, bpf,
  mounts, new namespaces or file locks, so it cannot reach out of its run or across rollouts;
- a fresh session keyring (none of the worker's keys are in reach) and no nested user namespaces;
- rlimits per process (CPU seconds, address space, processes of its uid, file size, open files), a
  wall-clock timeout, capped stdout/stderr and a private result channel (`process.py`).

After every run the sandbox's cgroup is killed and every process of its uid must be gone before the
uid is used again; a uid that cannot be cleaned is retired (kept leased, never reused) and replaced.
A warm pool keeps sandboxes started ahead of time (bwrap and the interpreter are up, waiting for a
program on stdin), sized to the rollout concurrency. Each sandbox runs one program and is thrown away.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.logs import get_logger
from pipeline.sandbox import SandboxResult, SandboxSettings, SandboxUnavailable
from pipeline.sandbox.cgroups import CgroupLimits, CgroupsUnavailable, SandboxCgroup, open_cgroups
from pipeline.sandbox.process import (
    RUNNER,
    ProgramProcess,
    kill_processes_of,
    processes_of,
    reap_orphans,
    run_program,
)
from pipeline.sandbox.scratch import ScratchSpace
from pipeline.sandbox.syscall_filter import filter_fd, filter_program, syscall_number
from pipeline.sandbox.uids import UidLease, lease_uids

__all__ = ["BwrapSandboxPool", "bwrap_argv", "reap_orphans"]

log = get_logger(__name__)

_PR_SET_CHILD_SUBREAPER = 36
_KEYCTL_JOIN_SESSION_KEYRING = 1
_libc = ctypes.CDLL(None, use_errno=True)


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


def bwrap_argv(
    settings: SandboxSettings, uid: int, *, seccomp_fd: int | None = None, scratch: ScratchSpace | None = None
) -> list[str]:
    """The command that starts one sandbox as `uid`, waiting for its program on stdin. `seccomp_fd`:
    a descriptor holding the filter program (`syscall_filter.filter_fd`), inherited by bwrap.
    `scratch`: bind its tmpfs for `uid` (prepared beforehand); without one, bwrap's own sized tmpfs
    mounts (no inode cap)."""
    bwrap, setpriv = _binaries(settings)
    if scratch is not None:
        writable = scratch.binds(uid)
    else:
        size = str(settings.tmpfs_mb << 20)
        writable = [arg for inside in ("/work", "/tmp", "/dev/shm") for arg in ("--size", size, "--tmpfs", inside)]
    seccomp = ["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        bwrap,
        "--unshare-all",
        "--unshare-user",  # explicit, for --disable-userns: no nested user namespace, capabilities and all
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        *seccomp,
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
        # bwrap's init (pid 1 here) runs as the sandbox's uid and is dumpable: through /proc/1/mem a
        # program could write into it and choose the exit status the host sees. Nothing of it shows.
        "--tmpfs",
        "/proc/1",
        "--remount-ro",
        "/proc/1",
        "--dev",
        "/dev",
        *writable,
        # bwrap's root and /dev are tmpfs mounts without a size: nothing may be written there.
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
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
        "TMPDIR",
        "/tmp",
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


def scratch_root(settings: SandboxSettings) -> Path:
    """Where this pool's scratch mounts go: one folder per uid lock folder, because the lock on a uid
    is what says whose its scratch is (a pool that leases elsewhere must not take ours for leftovers)."""
    key = hashlib.sha256(str(settings.uid_lock_dir.resolve()).encode()).hexdigest()[:12]
    return settings.scratch_dir / key


@dataclasses.dataclass
class _Warm:
    """One started sandbox waiting for its program."""

    proc: ProgramProcess
    sandbox_id: str
    uid: int
    cgroup: SandboxCgroup | None


def _become_subreaper() -> bool:
    """Orphaned sandbox processes (bwrap's PID-namespace init, once bwrap has exited) get reparented to
    us instead of to init: we reap them (zombies count against the sandbox uid's process limit) and
    read from them the CPU time the program used."""
    try:
        return _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _keyctl_number() -> int | None:
    """keyctl(2)'s number on this architecture (through libseccomp, which knows every one)."""
    try:
        return syscall_number("keyctl")
    except SandboxUnavailable:  # no libseccomp: start() says so
        return None


def _join_fresh_keyring(keyctl: int | None) -> None:
    """In the child, before exec: an anonymous session keyring of its own, so no key of the worker's
    session (or of another sandbox) is in reach even before seccomp denies keyctl altogether. Best
    effort: where keyctl is itself filtered (a container's default profile), nothing is reachable."""
    if keyctl is not None:
        _libc.syscall(keyctl, _KEYCTL_JOIN_SESSION_KEYRING, None)


class BwrapSandboxPool:
    """Warm, single-use bubblewrap sandboxes; `run` takes one, replaces it in the background."""

    def __init__(self, settings: SandboxSettings, *, hardened: bool = True):
        """`hardened=False` leaves out the cgroup, the seccomp filter, the scratch tmpfs and the fresh
        keyring: the sandbox as it was before them, only for `sprawl bench sandbox` to measure what
        they cost. Never for programs that are not the benchmark's own."""
        self.settings = settings
        self.hardened = hardened
        _binaries(settings)  # fail now, naming the package, if bubblewrap is missing
        self.slots = max(settings.pool_size, 1) * 2
        self.leases: list[UidLease] = []
        self.retired: list[int] = []
        """uids that could not be cleaned after a run: still leased (no one else gets them), never reused."""
        self.cgroups = None
        self.scratch: ScratchSpace | None = ScratchSpace(
            scratch_root(settings), size_mb=settings.tmpfs_mb, max_inodes=settings.max_inodes
        )
        self.limits = CgroupLimits(
            memory_bytes=settings.memory_mb << 20, pids=settings.max_processes, cpus=settings.cpus
        )
        self._keyctl = _keyctl_number()
        self._ready: asyncio.Queue[_Warm] = asyncio.Queue()
        self._free_uids: asyncio.Queue[int] = asyncio.Queue()
        self._spawning: set[asyncio.Task] = set()
        self._cleaning: set[asyncio.Task] = set()
        self._running: set[asyncio.Task] = set()
        self._subreaper = False
        # One thread starts sandboxes (see `_started`): starts stay in order, and Popen's fork happens
        # with no other spawn in flight.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawn")
        self.cold_starts = 0

    @property
    def uids(self) -> tuple[int, ...]:
        """The uids this pool's sandboxes run (or ran) as: leased at start, for this pool alone."""
        assert self.leases, "start() the pool first"
        return tuple(uid for lease in self.leases for uid in lease.uids)

    async def start(self) -> None:
        """Check what isolation this host allows, lease uids, start the warm sandboxes, and run one
        program: a host where bubblewrap cannot start a sandbox (no user namespaces, say) fails here,
        not as a crash on every reward."""
        s = self.settings
        if self.hardened:
            filter_program()  # SandboxUnavailable, naming the package, without libseccomp
            await self._open_cgroups()
            try:
                self.scratch.check()
            except SandboxUnavailable as exc:
                log.warning(
                    "SANDBOX SCRATCH HAS NO INODE CAP: bubblewrap's own sized tmpfs mounts instead",
                    reason=exc.message,
                )
                self.scratch = None
        else:
            self.scratch = None
        if self.scratch is not None:
            self._sweep_scratch(self.scratch)
        lease = self._lease(self.slots)
        self._subreaper = _become_subreaper()
        for uid in lease.uids:
            self._free_uids.put_nowait(uid)
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
        log.info(
            "sandbox pool started",
            uids=f"{lease.first}..{lease.first + lease.count - 1}",
            cgroups=f"v{self.cgroups.version}" if self.cgroups else "none",
            scratch="tmpfs with inode cap" if self.scratch else "bwrap tmpfs",
        )

    async def _open_cgroups(self) -> None:
        opened = open_cgroups(f"sandbox pool of pid {os.getpid()}")
        if isinstance(opened, CgroupsUnavailable):
            # The strongest limits left are per process: RLIMIT_AS per process, RLIMIT_NPROC per uid.
            log.warning(
                "SANDBOXES HAVE NO CGROUP: memory and process limits are per process, not per sandbox",
                reason=opened.reason,
                hint=opened.hint,
                fallback="RLIMIT_AS per process, RLIMIT_NPROC per sandbox uid, sized tmpfs",
            )
            return
        self.cgroups = opened
        await opened.sweep_stale()  # a SIGKILLed worker's sandboxes: killed, their cgroups removed

    def _sweep_scratch(self, scratch: ScratchSpace) -> None:
        """Detach the scratch mounts a crashed pool left (a SIGKILLed worker cleans nothing): those of
        uids no live pool leases (a lease is held by its pool for as long as it lives) and nothing runs
        as (a pool that leases through another lock folder is refused at start, but only after this)."""
        s = self.settings
        for uid in scratch.leftovers():
            if processes_of((uid,)):
                continue
            try:
                lease = lease_uids(1, uid_base=uid, uid_span=1, lock_dir=s.uid_lock_dir)
            except SandboxUnavailable:
                continue  # a live pool's
            try:
                scratch.release(uid)
            finally:
                lease.release()

    def _lease(self, count: int) -> UidLease:
        """`count` more uids for this pool, or SandboxUnavailable. A process already running as one of
        them belongs to a pool that leases elsewhere (a second worker with another `uid_lock_dir`,
        another container on this host): sharing the uids would share process limits and make "every
        process of the uid is gone" unverifiable, so such a lease is given back and refused."""
        s = self.settings
        lease = lease_uids(count, uid_base=s.uid_base, uid_span=s.uid_span, lock_dir=s.uid_lock_dir)
        if others := processes_of(lease.uids):
            lease.release()
            raise SandboxUnavailable(
                f"sandbox uids {lease.first}..{lease.first + lease.count - 1} are already in use on this host "
                f"(by pids {', '.join(map(str, others[:5]))}), though no pool here leases them",
                hint="give each reward worker on a host the same SPRAWL_SANDBOX__UID_LOCK_DIR, or disjoint "
                "SPRAWL_SANDBOX__UID_BASE ranges",
            )
        self.leases.append(lease)
        return lease

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
        uid = await self._free_uids.get()
        cgroup = None
        seccomp = -1
        try:
            if self.scratch is not None:
                self.scratch.prepare(uid)
            sandbox_id = f"bwrap-{uid}-{uuid.uuid4().hex[:8]}"
            if self.cgroups is not None:
                cgroup = self.cgroups.create(sandbox_id, self.limits)
            seccomp = filter_fd() if self.hardened else -1
            keyctl = self._keyctl if self.hardened else None

            def before_exec() -> None:  # in the child, as root, before setpriv drops to `uid`
                if cgroup is not None:
                    cgroup.join_from_preexec()
                _join_fresh_keyring(keyctl)

            start = functools.partial(
                ProgramProcess.start,
                bwrap_argv(self.settings, uid, seccomp_fd=seccomp if seccomp >= 0 else None, scratch=self.scratch),
                self.settings,
                env={"PATH": "/usr/bin"},
                helper_uid=uid if self._subreaper else None,
                pass_fds=(seccomp,) if seccomp >= 0 else (),
                before_exec=before_exec,
            )
            proc = await self._started(start)
        except BaseException:
            # Never started: nothing ran as `uid`, so it goes straight back (a failed start must not shrink the pool).
            if cgroup is not None:
                await cgroup.remove()
            if self.scratch is not None:
                self.scratch.release(uid)
            self._free_uids.put_nowait(uid)
            raise
        finally:
            if seccomp >= 0:
                os.close(seccomp)
        return _Warm(proc, sandbox_id, uid, cgroup)

    async def _started(self, start: Callable[[], ProgramProcess]) -> ProgramProcess:
        """Start a sandbox off the event loop: Popen returns only once the child has exec'd, after it
        joined its cgroup, and a cgroup v1 move waits for an RCU grace period per hierarchy (about 3 ms
        each): on the loop, every refill would stall the programs running meanwhile. A start that is
        cancelled is seen through and its process finished, so nothing runs as a uid we give back."""
        spawn = asyncio.get_running_loop().run_in_executor(self._spawner, start)
        try:
            return await asyncio.shield(spawn)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await (await spawn).finish()
            raise

    async def run(self, program: str) -> SandboxResult:
        try:
            warm = self._ready.get_nowait()
        except asyncio.QueueEmpty:
            self.cold_starts += 1
            warm = await self._spawn()
        else:
            self._refill()
        task = asyncio.current_task()
        self._running.add(task)
        try:
            result = await run_program(warm.proc, warm.sandbox_id, program, self.settings)
            return self._with_cgroup_verdict(result, warm.cgroup)
        finally:
            self._running.discard(task)
            await self._discard(warm)

    @staticmethod
    def _with_cgroup_verdict(result: SandboxResult, cgroup: SandboxCgroup | None) -> SandboxResult:
        """What the sandbox's cgroup saw: an OOM kill inside it (a memfd or tmpfs filled past the
        limit ends that way) is a memory verdict, a fork refused at its pids limit a process one."""
        if cgroup is None:
            return result
        usage = cgroup.usage()
        return dataclasses.replace(result, memory_limited=usage.oom_kills > 0, processes_limited=usage.pids_limited)

    async def _discard(self, warm: _Warm) -> None:
        """Kill what is left of the sandbox, then clean its uid in the background: the caller has its result."""
        await warm.proc.finish()
        task = asyncio.create_task(self._clean(warm))
        self._cleaning.add(task)
        task.add_done_callback(self._cleaning.discard)

    async def _clean(self, warm: _Warm) -> None:
        """Every process of the sandbox gone (its cgroup first, then anything of its uid anywhere on the
        host), its scratch detached; only then is its uid free for another sandbox. A uid that cannot be
        cleaned in `cleanup_patience_s` is retired, loudly: the pool never reuses a dirty uid."""
        patience = self.settings.cleanup_patience_s
        try:
            if warm.cgroup is not None:
                async with asyncio.timeout(patience):
                    await warm.cgroup.remove()  # kills what is left in it first
            if self.scratch is not None:
                self.scratch.release(warm.uid)
            survivors = await kill_processes_of(warm.uid, patience)
        except (OSError, TimeoutError) as exc:
            self._retire(warm.uid, f"cleaning up {warm.sandbox_id} failed: {exc!r}")
            return
        if survivors:
            self._retire(warm.uid, f"processes {survivors[:10]} survived the kill after {patience} s")
            return
        self._free_uids.put_nowait(warm.uid)

    def _retire(self, uid: int, why: str) -> None:
        """`uid` could not be cleaned after its sandbox was killed: keep it leased but unused, and
        lease a fresh uid in its place so the pool keeps its size."""
        self.retired.append(uid)
        log.error("sandbox uid retired: it could not be cleaned after its run", uid=uid, why=why)
        try:
            lease = self._lease(1)
        except SandboxUnavailable as exc:
            log.error("no uid to replace a retired one: the pool runs one sandbox fewer", error=exc.message)
            return
        self._free_uids.put_nowait(lease.first)

    async def settled(self) -> None:
        """Wait until every sandbox that has run is cleaned up: its uid free again, or retired."""
        while self._cleaning:
            await asyncio.gather(*list(self._cleaning), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._spawning):
            task.cancel()
        if self._spawning:
            await asyncio.gather(*self._spawning, return_exceptions=True)
        while not self._ready.empty():
            await self._discard(self._ready.get_nowait())
        if self._running:  # runs in flight end by themselves (their wall timeout bounds them): never a fake verdict
            await asyncio.wait(list(self._running))
        await self.settled()
        if self.cgroups is not None:
            await self.cgroups.close()
        for lease in self.leases:
            reap_orphans(lease.uids)
            if self.scratch is not None:
                for uid in lease.uids:
                    self.scratch.forget(uid)
            lease.release()
        self._spawner.shutdown(wait=False)
