"""Running untrusted (model-written) programs where they can harm nothing.

A sandbox backend is one module here plus one entry in `SANDBOX_BACKENDS`, chosen by
`sandbox.backend`:

- `bwrap` (`bubblewrap.py`): every program in its own unprivileged uid and fresh namespaces, no
  network, a read-only `/usr` and nothing else of the host, rlimits, a wall-clock timeout; a warm
  pool keeps sandboxes started ahead of time. The default, and the only one for untrusted code.
- `none` (`unsandboxed.py`): the same limits without isolation, for trusted verifiers only.
- `modal` (`modal.py`): Modal Sandboxes, when the `modal` package is installed.

Backends are imported only when chosen, so a worker that never runs programs never needs one.
This module holds what every backend shares: the settings, the result and how it is classified.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Protocol

from pydantic import Field, ValidationInfo, field_validator

from pipeline.config import Section, registered
from pipeline.errors import SprawlError

if TYPE_CHECKING:
    from pipeline.sandbox.bubblewrap import BwrapSandboxPool, bwrap_argv, reap_orphans
    from pipeline.sandbox.modal import ModalSandboxRunner, modal_sandbox_request
    from pipeline.sandbox.unsandboxed import UnsandboxedRunner

__all__ = [
    "SANDBOX_BACKENDS",
    "BwrapSandboxPool",
    "ModalSandboxRunner",
    "Sandbox",
    "SandboxResult",
    "SandboxSettings",
    "SandboxUnavailable",
    "UnsandboxedRunner",
    "bwrap_argv",
    "modal_sandbox_request",
    "open_sandbox",
    "reap_orphans",
]


UID_LIMIT = 2**32 - 1
"""(uid_t)-1 means "no uid" to the kernel: every sandbox uid is below it."""


class SandboxSettings(Section):
    backend: str = "bwrap"
    """A key of `SANDBOX_BACKENDS`: `bwrap` (isolated), `none` (trusted verifiers only; logs a warning),
    `modal` (needs the modal package)."""
    bwrap: str = Field("bwrap", min_length=1)
    """The bubblewrap binary: a name looked up on PATH, or a path (Debian package `bubblewrap`)."""
    python: str = "/usr/bin/python3"
    """Interpreter inside the sandbox, an absolute path (for `bwrap`, under /usr: the only host tree
    mounted)."""
    cpu_seconds: int = Field(5, ge=1)
    """RLIMIT_CPU: past it the kernel sends SIGXCPU (and SIGKILL one second later)."""
    memory_mb: int = Field(512, ge=1)
    """Memory of the whole sandbox: its cgroup's limit, counting every process, tmpfs and memfd pages
    (swap excluded); also each process's RLIMIT_AS."""
    max_processes: int = Field(32, ge=1)
    """Processes of the whole sandbox (its cgroup's pids limit), and RLIMIT_NPROC of its own uid."""
    cpus: float = Field(1.0, gt=0)
    """CPU bandwidth of the whole sandbox, in cores (its cgroup's CFS quota): a program's threads
    cannot take the reward worker's cores."""
    max_file_mb: int = Field(16, ge=1)
    """RLIMIT_FSIZE."""
    max_open_files: int = Field(64, ge=1)
    """RLIMIT_NOFILE."""
    wall_timeout_s: float = Field(10.0, gt=0)
    """Wall clock from submission; the whole sandbox is killed when it passes."""
    max_output_bytes: int = Field(64 * 1024, ge=1)
    """stdout and stderr are each cut (and the program killed) past this."""
    max_result_bytes: int = Field(256 * 1024, ge=1)
    """The private result channel (`SandboxResult.channel`) is cut (and the program killed) past this."""
    pool_size: int = Field(4, ge=0)
    """Warm sandboxes kept ready: size it to the rollout concurrency (0: every program starts a
    sandbox cold)."""
    uid_base: int = Field(61000, ge=1000, lt=UID_LIMIT)
    """First uid sandboxes may run as (1000 or above: never a system account's). Each pool leases its
    own range of uids above it (one uid per slot, so process limits are per sandbox and no two pools on
    a host share a uid)."""
    uid_span: int = Field(4096, ge=1, validate_default=True)
    """How many uids above `uid_base` pools may lease from (every pool on a host shares this space); a
    bubblewrap pool leases 2 * max(pool_size, 1) of them, and uid_base + uid_span stays below 2**32 - 1."""
    uid_lock_dir: Path = Path("/tmp/sprawl-sandbox-uids")
    """Where uid leases are held: one flock'ed file per uid, released when the pool closes or its
    process exits."""
    tmpfs_mb: int = Field(64, ge=1)
    """Size of the sandbox's scratch space: one fresh tmpfs for `/work`, `/tmp` and `/dev/shm`
    together (the rest of its tree is read-only)."""
    max_inodes: int = Field(16384, ge=16)
    """Files and folders the scratch space may hold (the tmpfs inode cap)."""
    scratch_dir: Path = Path("/tmp/sprawl-sandbox-scratch")
    """Where scratch spaces are mounted on the host, one per sandbox uid (a root-owned folder)."""
    cleanup_patience_s: float = Field(30.0, gt=0)
    """After a run, how long the processes of a sandbox's uid may take to end once killed; a uid
    still running something after that is retired (never reused) and replaced by a fresh one."""

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, value: str) -> str:
        return registered(value, SANDBOX_BACKENDS, "sandbox backend")

    @field_validator("python")
    @classmethod
    def _absolute_interpreter(cls, value: str) -> str:
        if not PurePosixPath(value).is_absolute():
            raise ValueError(f"{value!r} is not an absolute path: the sandbox has no PATH to look it up on")
        return value

    @field_validator("uid_span")
    @classmethod
    def _uids_fit(cls, value: int, info: ValidationInfo) -> int:
        base, pool_size = info.data.get("uid_base"), info.data.get("pool_size")
        if base is not None and base + value > UID_LIMIT:
            raise ValueError(f"uid_base + uid_span is {base + value}: the last uid must stay below {UID_LIMIT}")
        if pool_size is not None and pool_slots(pool_size) > value:
            raise ValueError(
                f"a pool of {pool_size} warm sandboxes leases {pool_slots(pool_size)} uids, more than uid_span: "
                "raise it or lower pool_size"
            )
        return value


def pool_slots(pool_size: int) -> int:
    """uids a bubblewrap pool of `pool_size` warm sandboxes leases (`BwrapSandboxPool.slots`): twice the
    pool, and at least 2, so that a pool of 0 still runs programs (each started cold)."""
    return max(pool_size, 1) * 2


class SandboxUnavailable(SprawlError):
    """The configured backend cannot run programs here (a binary is missing, a package, a uid)."""


@dataclass(frozen=True)
class SandboxResult:
    sandbox_id: str
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool
    """We killed it because the wall clock passed while it was still running."""
    output_truncated: bool
    """We killed it because stdout or stderr passed `max_output_bytes`."""
    cpu_limited: bool = False
    """The kernel stopped it for passing RLIMIT_CPU (SIGXCPU, or SIGKILL at the hard limit)."""
    cpu_seconds: float | None = None
    """CPU time the kernel accounted to the program (None where the backend cannot tell)."""
    memory_limited: bool = False
    """The sandbox's cgroup ran out of memory and the kernel killed a process of it (where the
    backend has a cgroup)."""
    processes_limited: bool = False
    """A fork or clone failed on the sandbox's cgroup pids limit (where the backend has a cgroup)."""
    channel: bytes = b""
    """What the program wrote on its private result channel (see `process.ProgramProcess`); empty
    where the backend has none."""

    @property
    def error_class(self) -> str | None:
        """A stable name for how the program ended (None: it exited 0 within every limit)."""
        if self.timed_out:
            return "timeout"
        if self.output_truncated:
            return "output_limit"
        if self.cpu_limited:
            return "cpu"
        if self.memory_limited:
            return "memory"
        if self.signal == signal.SIGXFSZ or "File too large" in self.stderr:
            return "file_size"
        if self.signal is not None:
            return "killed"
        text = self.stderr
        if self.processes_limited and self.exit_code:
            return "process_limit"
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
            ("No space left on device", "disk"),
        ):
            if needle in text:
                return name
        if self.exit_code:
            return "crash"
        return None


class Sandbox(Protocol):
    """What a backend offers: start once, run programs (each in a fresh sandbox), close once."""

    async def start(self) -> None: ...

    async def run(self, program: str) -> SandboxResult: ...

    async def close(self) -> None: ...


def _bubblewrap(settings: SandboxSettings) -> Sandbox:
    from pipeline.sandbox.bubblewrap import BwrapSandboxPool

    return BwrapSandboxPool(settings)


def _unsandboxed(settings: SandboxSettings) -> Sandbox:
    from pipeline.sandbox.unsandboxed import UnsandboxedRunner

    return UnsandboxedRunner(settings)


def _modal(settings: SandboxSettings) -> Sandbox:
    from pipeline.sandbox.modal import ModalSandboxRunner

    return ModalSandboxRunner(settings)


SANDBOX_BACKENDS: dict[str, Callable[[SandboxSettings], Sandbox]] = {
    "bwrap": _bubblewrap,
    "none": _unsandboxed,
    "modal": _modal,
}
"""Backend name (`sandbox.backend`) -> factory. A factory checks what its backend needs and raises
`SandboxUnavailable` naming what to install, so a worker fails at start, not at its first program."""


def open_sandbox(settings: SandboxSettings) -> Sandbox:
    """The configured backend, checked but not started (`await sandbox.start()` starts it)."""
    try:
        factory = SANDBOX_BACKENDS[settings.backend]
    except KeyError:
        raise SprawlError(
            f"unknown sandbox backend {settings.backend!r}",
            hint=f"set sandbox.backend (SPRAWL_SANDBOX__BACKEND) to one of {', '.join(sorted(SANDBOX_BACKENDS))}",
        ) from None
    return factory(settings)


_LAZY = {
    "BwrapSandboxPool": "pipeline.sandbox.bubblewrap",
    "bwrap_argv": "pipeline.sandbox.bubblewrap",
    "reap_orphans": "pipeline.sandbox.bubblewrap",
    "UnsandboxedRunner": "pipeline.sandbox.unsandboxed",
    "ModalSandboxRunner": "pipeline.sandbox.modal",
    "modal_sandbox_request": "pipeline.sandbox.modal",
}


def __getattr__(name: str) -> object:
    """Backend names stay importable from `pipeline.sandbox` without importing every backend up front."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
