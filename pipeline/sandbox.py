"""Running untrusted (model-written) programs where they can harm nothing.

The bubblewrap backend starts every sandbox as its own unprivileged uid in fresh user, PID,
network, IPC and UTS namespaces: no network but its own empty loopback, a read-only `/usr` and
nothing else of the host (no `/root`, no `/etc`, no home, a clean environment), a private tmpfs as
the working directory, rlimits on CPU seconds, address space, processes, file size and open
files, a wall-clock timeout that kills the whole PID namespace, and capped stdout/stderr.

A warm pool keeps sandboxes started ahead of time (bwrap and the interpreter are already up,
waiting for a program on stdin), sized to the rollout concurrency, so a verification never waits
on start-up. Each sandbox runs one program and is thrown away.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pipeline.config import Section
from pipeline.errors import SprawlError
from pipeline.logs import get_logger

log = get_logger(__name__)

# Reads the program from stdin, then runs it as __main__: everything before is start-up paid in the pool.
_RUNNER = "import sys; _src = sys.stdin.read(); exec(compile(_src, '<sandbox>', 'exec'), {'__name__': '__main__'})"


class SandboxSettings(Section):
    backend: Literal["bwrap", "none", "modal"] = "bwrap"
    """`bwrap` (isolated), `none` (trusted verifiers only; logs a warning), `modal` (needs the modal package)."""
    python: str = "/usr/bin/python3"
    """Interpreter inside the sandbox (must live under /usr, the only host tree mounted)."""
    cpu_seconds: int = 5
    """RLIMIT_CPU."""
    memory_mb: int = 512
    """RLIMIT_AS."""
    max_processes: int = 32
    """RLIMIT_NPROC for the sandbox's own uid."""
    max_file_mb: int = 16
    """RLIMIT_FSIZE."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    wall_timeout_s: float = 10.0
    """Wall clock from submission; the whole sandbox is killed when it passes."""
    max_output_bytes: int = 64 * 1024
    """stdout and stderr are each cut (and the program killed) past this."""
    pool_size: int = 4
    """Warm sandboxes kept ready: size it to the rollout concurrency."""
    uid_base: int = 61000
    """Sandbox slot i runs as uid uid_base + i, so process limits are per sandbox."""
    tmpfs_mb: int = 64
    """Size of the private working directory."""


class SandboxUnavailable(SprawlError):
    pass


@dataclass(frozen=True)
class SandboxResult:
    sandbox_id: str
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool
    output_truncated: bool

    @property
    def error_class(self) -> str | None:
        """A stable name for how the program ended (None: it exited 0 within every limit)."""
        if self.timed_out:
            return "timeout"
        if self.output_truncated:
            return "output_limit"
        if self.signal == signal.SIGXCPU:
            return "cpu"
        if self.signal == signal.SIGXFSZ or "File too large" in self.stderr:
            return "file_size"
        if self.signal is not None:
            return "killed"
        text = self.stderr
        for needle, name in (
            ("MemoryError", "memory"),
            ("Cannot allocate memory", "memory"),
            ("BlockingIOError", "process_limit"),
            ("Resource temporarily unavailable", "process_limit"),
            ("ConnectionRefusedError", "network"),
            ("Network is unreachable", "network"),
            ("socket.gaierror", "network"),
            ("Read-only file system", "permission"),
            ("PermissionError", "permission"),
            ("FileNotFoundError", "permission"),
            ("Too many open files", "open_files"),
        ):
            if needle in text:
                return name
        if self.exit_code:
            return "crash"
        return None


def _limits(settings: SandboxSettings):
    def apply() -> None:
        os.setsid()  # its own process group: the timeout kills the group
        resource.setrlimit(resource.RLIMIT_CPU, (settings.cpu_seconds, settings.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (settings.memory_mb << 20, settings.memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_NPROC, (settings.max_processes, settings.max_processes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (settings.max_file_mb << 20, settings.max_file_mb << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (settings.max_open_files, settings.max_open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def bwrap_argv(settings: SandboxSettings, uid: int) -> list[str]:
    bwrap = shutil.which("bwrap")
    setpriv = shutil.which("setpriv")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed", hint="apt-get install bubblewrap")
    if setpriv is None:
        raise SandboxUnavailable("setpriv is not installed", hint="apt-get install util-linux")
    if not settings.python.startswith("/usr/"):
        raise SandboxUnavailable(
            f"sandbox interpreter {settings.python} is not under /usr",
            hint="install Debian's python3 or set SPRAWL_SANDBOX__PYTHON to one under /usr",
        )
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
        _RUNNER,
    ]


class _Warm:
    """One started sandbox waiting for its program."""

    def __init__(self, proc: asyncio.subprocess.Process, sandbox_id: str, slot: int):
        self.proc, self.sandbox_id, self.slot = proc, sandbox_id, slot


async def _read_capped(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, bool]:
    data = bytearray()
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return bytes(data), False
        data += chunk
        if len(data) > limit:
            return bytes(data[:limit]), True


def _become_subreaper() -> bool:
    """Orphaned sandbox processes (bwrap's helper, when bwrap is killed) get reparented to us instead of
    to init, so we can reap them: zombies count against the sandbox uid's process limit."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap_orphans(keep: set[int]) -> int:
    """Reap zombie children of this process that asyncio does not manage (`keep`)."""
    me, reaped = os.getpid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in keep:
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) == me:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry), os.WNOHANG)
                reaped += 1
    return reaped


class BwrapSandboxPool:
    """Warm, single-use bubblewrap sandboxes; `run` takes one, replaces it in the background."""

    def __init__(self, settings: SandboxSettings):
        self.settings = settings
        bwrap_argv(settings, settings.uid_base)  # fail now, naming the package, if bubblewrap is missing
        self._ready: asyncio.Queue[_Warm] = asyncio.Queue()
        self._free_slots: asyncio.Queue[int] = asyncio.Queue()
        self._spawning: set[asyncio.Task] = set()
        self._live: set[int] = set()
        self._reaper: asyncio.Task | None = None
        self.cold_starts = 0

    async def start(self) -> None:
        if _become_subreaper():
            self._reaper = asyncio.create_task(self._reap_forever())
        for slot in range(max(self.settings.pool_size, 1) * 2):
            self._free_slots.put_nowait(slot)
        for _ in range(self.settings.pool_size):
            self._refill()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            reap_orphans(self._live)

    def _refill(self) -> None:
        task = asyncio.create_task(self._spawn_into_pool())
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def _spawn_into_pool(self) -> None:
        warm = await self._spawn()
        await self._ready.put(warm)

    async def _spawn(self) -> _Warm:
        slot = await self._free_slots.get()
        uid = self.settings.uid_base + slot
        proc = await asyncio.create_subprocess_exec(
            *bwrap_argv(self.settings, uid),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=_limits(self.settings),
            env={"PATH": "/usr/bin"},
        )
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
            return await _execute(warm.proc, warm.sandbox_id, program, self.settings)
        finally:
            await _kill_group(warm.proc)
            self._live.discard(warm.proc.pid)
            reap_orphans(self._live)  # before the slot's uid is reused: its zombies count against NPROC
            self._free_slots.put_nowait(warm.slot)

    async def close(self) -> None:
        if self._spawning:
            await asyncio.gather(*self._spawning, return_exceptions=True)
        while not self._ready.empty():
            warm = self._ready.get_nowait()
            await _kill_group(warm.proc)
            self._live.discard(warm.proc.pid)
        await asyncio.sleep(0.05)
        reap_orphans(self._live)
        if self._reaper is not None:
            self._reaper.cancel()


async def _execute(
    proc: asyncio.subprocess.Process, sandbox_id: str, program: str, settings: SandboxSettings
) -> SandboxResult:
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    started = time.perf_counter()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(program.encode())
        await proc.stdin.drain()
        proc.stdin.close()
    out_task = asyncio.create_task(_read_capped(proc.stdout, settings.max_output_bytes))
    err_task = asyncio.create_task(_read_capped(proc.stderr, settings.max_output_bytes))
    timed_out = truncated = False
    try:
        _done, _ = await asyncio.wait(
            {out_task, err_task}, timeout=settings.wall_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        while not (out_task.done() and err_task.done()):
            if any(t.done() and t.result()[1] for t in (out_task, err_task)):
                truncated = True
                break
            remaining = settings.wall_timeout_s - (time.perf_counter() - started)
            if remaining <= 0:
                timed_out = True
                break
            await asyncio.wait({out_task, err_task}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        if any(t.done() and t.result()[1] for t in (out_task, err_task)):
            truncated = True
        if not (timed_out or truncated):
            remaining = max(0.0, settings.wall_timeout_s - (time.perf_counter() - started))
            try:
                await asyncio.wait_for(proc.wait(), timeout=remaining)
            except TimeoutError:
                timed_out = True
    finally:
        if timed_out or truncated:
            await _kill_group(proc)
    out, _ = out_task.result() if out_task.done() else (b"", False)
    err, _ = err_task.result() if err_task.done() else (b"", False)
    for task in (out_task, err_task):
        task.cancel()
    code = proc.returncode
    # bwrap reports a program killed by signal N as exit status 128 + N.
    sig = -code if code is not None and code < 0 else (code - 128 if code is not None and code > 128 else None)
    return SandboxResult(
        sandbox_id=sandbox_id,
        exit_code=code if code is not None and 0 <= code <= 128 else None,
        signal=sig,
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        duration_s=time.perf_counter() - started,
        timed_out=timed_out,
        output_truncated=truncated,
    )


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """Kill the sandbox's process group; bwrap's death takes its whole PID namespace with it."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    # asyncio only reports the exit once the pipes hit EOF: drain what a killed program left unread.
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(_discard(stream), 5)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(proc.wait(), 5)


async def _discard(stream: asyncio.StreamReader) -> None:
    while await stream.read(1 << 20):
        pass


class UnsandboxedRunner:
    """`sandbox: none`: for trusted verifiers only. Same limits, no isolation."""

    def __init__(self, settings: SandboxSettings):
        self.settings = settings
        log.warning("sandbox backend is `none`: verifier programs run WITHOUT isolation; use only for trusted code")

    async def start(self) -> None:
        return None

    async def run(self, program: str) -> SandboxResult:
        proc = await asyncio.create_subprocess_exec(
            self.settings.python,
            "-I",
            "-S",
            "-c",
            _RUNNER,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=_limits(self.settings),
        )
        try:
            return await _execute(proc, f"none-{uuid.uuid4().hex[:8]}", program, self.settings)
        finally:
            await _kill_group(proc)

    async def close(self) -> None:
        return None


def modal_sandbox_request(settings: SandboxSettings, program: str) -> dict:
    """How a program maps onto `modal.Sandbox.create(...)`: the same limits, no network, one exec."""
    return {
        "args": ["python", "-I", "-S", "-c", program],
        "timeout": int(settings.wall_timeout_s),
        "cpu": 1.0,
        "memory": settings.memory_mb,
        "block_network": True,
        "workdir": "/work",
    }


class ModalSandboxRunner:
    """Optional backend: Modal Sandboxes, when the `modal` package is installed and configured."""

    def __init__(self, settings: SandboxSettings):
        try:
            import modal  # noqa: F401
        except ImportError as exc:
            raise SandboxUnavailable(
                "the modal sandbox backend needs the `modal` package", hint="pip install modal, then `modal token new`"
            ) from exc
        self.settings = settings

    async def start(self) -> None:
        return None

    async def run(self, program: str) -> SandboxResult:
        import modal

        request = modal_sandbox_request(self.settings, program)
        started = time.perf_counter()
        app = modal.App.lookup("sprawl-sandbox", create_if_missing=True)
        sandbox = await modal.Sandbox.create.aio(*request.pop("args"), app=app, **request)
        await sandbox.wait.aio()
        stdout = (await sandbox.stdout.read.aio())[: self.settings.max_output_bytes]
        stderr = (await sandbox.stderr.read.aio())[: self.settings.max_output_bytes]
        return SandboxResult(
            sandbox_id=f"modal-{sandbox.object_id}",
            exit_code=sandbox.returncode,
            signal=None,
            stdout=stdout,
            stderr=stderr,
            duration_s=time.perf_counter() - started,
            timed_out=sandbox.returncode is None,
            output_truncated=False,
        )

    async def close(self) -> None:
        return None


def open_sandbox(settings: SandboxSettings):
    if settings.backend == "bwrap":
        return BwrapSandboxPool(settings)
    if settings.backend == "none":
        return UnsandboxedRunner(settings)
    return ModalSandboxRunner(settings)
