"""A sandbox is a cgroup, not a process: limits on a sandbox as a whole.

rlimits are per process: 32 processes of 512 MB each is 16 GB, and pages a program puts in a tmpfs
or a memfd belong to no process's address space at all. A cgroup counts every page charged by
anything inside it (anonymous memory, tmpfs and memfd pages, page cache), every task, and all of
their CPU time, and can kill all of them at once whatever they did to their sessions and process
groups. So each sandbox gets a cgroup of its own, made before its first process starts:

- `open_cgroups(owner)` finds a usable cgroup hierarchy and creates this pool's parent in it,
  `sprawl-sandbox-<pid>-<8 hex>`, under this process's own cgroup. It returns a `CgroupHierarchy`,
  or a `CgroupsUnavailable` that says why not (it never raises for that: a host without cgroups
  is a configuration to report loudly, and the pool falls back to rlimits).
- `hierarchy.create(name, limits)` makes one sandbox's cgroup under that parent, limits set.
- `sandbox.join_from_preexec` is the `preexec_fn` (or the first thing in it) that moves the child
  into the cgroup between fork and exec, so nothing the program does runs outside it.
- `await sandbox.kill_all()`, `sandbox.usage()`, `await sandbox.remove()`.
- `await hierarchy.sweep_stale()` removes the parents of pools whose process died (a SIGKILLed
  reward worker cannot clean up after itself), and `await hierarchy.close()` removes this pool's.

Two layouts are supported. cgroup v2 (one unified tree, production hosts): usable when memory and
pids can be enabled for children of the cgroup we create under; cpu is optional. cgroup v1 (one
tree per controller, as on the CI machines): memory and pids required; cpu, cpuacct (CPU time) and
freezer (race-free killing) are used when mounted. v2 is preferred when both are usable.

Limits in force (see `CgroupLimits`): memory including swap (v2 `memory.max` + `memory.swap.max=0`,
v1 `memory.limit_in_bytes` = `memory.memsw.limit_in_bytes`), tasks (`pids.max`) and CPU bandwidth
(v2 `cpu.max`, v1 `cpu.cfs_quota_us`).

How a program is stopped at the memory limit (kernel 6.18, cgroup v1, measured by the tests): an
anonymous allocation, a write to a tmpfs file and a write to a memfd all end the same way, the writer
SIGKILLed by the OOM killer (counted in `CgroupUsage.oom_kills`), never an ENOMEM or ENOSPC from the
write. Pages left in a tmpfs stay charged after their writer dies, until the tmpfs goes (for a
bubblewrap sandbox, with its mount namespace). So "killed, and `oom_kills` went up" is how a sandbox
that ran out of memory is told apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import secrets
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pipeline.logs import get_logger

log = get_logger(__name__)

PARENT_PREFIX = "sprawl-sandbox-"
_PARENT_NAME = re.compile(r"^sprawl-sandbox-(\d+)-[0-9a-f]{8}$")
_SANDBOX_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
REQUIRED_CONTROLLERS = ("memory", "pids")
CPU_PERIOD_US = 100_000
"""The CFS period: the quota is `cpus` times this, so a sandbox at its limit runs in bursts of at most
100 ms (the kernel default period)."""
_V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")
_MIN_CPU_QUOTA_US = 1000  # the kernel refuses smaller quotas
_MAX_POLL_S = 0.05
_SLOW_KILL_WARNING_S = 10.0
_FREEZE_POLLS = 40
"""How often a kill round re-reads the freezer state before killing anyway: freezing only keeps forks
from racing the kill, and a task stuck in the kernel must not stall the kill forever."""
_RMDIR_BUSY_TRIES = 200


@dataclass(frozen=True)
class CgroupLimits:
    memory_bytes: int
    """The whole sandbox: every process, and tmpfs and memfd pages too. Swap cannot extend it."""
    pids: int
    """Tasks (threads count, as the kernel counts them) alive in the sandbox at once."""
    cpus: float
    """CPU bandwidth in cores: 0.5 is half of one core's time, 2.0 two cores' worth."""

    def __post_init__(self) -> None:
        if self.memory_bytes < 1 << 20:
            raise ValueError(f"memory_bytes={self.memory_bytes}: a sandbox needs at least 1 MiB")
        if self.pids < 1:
            raise ValueError(f"pids={self.pids}: a sandbox needs at least one task")
        if not self.cpus > 0:
            raise ValueError(f"cpus={self.cpus}: must be above 0")


@dataclass(frozen=True)
class CgroupUsage:
    oom_kills: int
    """Processes the kernel's OOM killer killed for passing the memory limit."""
    memory_limit_hits: int
    """Times a charge hit the limit (v2 memory.events `max`, v1 `failcnt`). Kernels that stopped
    tracking v1 `failcnt` report 0 here: `oom_kills` is the count to trust."""
    memory_peak_bytes: int | None
    """The most memory charged at once (None where the kernel does not record it)."""
    pids_limited: bool
    """A fork or clone failed because the sandbox was at its task limit."""
    pids_peak: int | None
    cpu_seconds: float | None
    """CPU time of every task that ever ran in the sandbox (None without cpuacct on v1)."""
    cpu_throttled_periods: int | None
    """CFS periods in which the sandbox ran out of its CPU quota (None without the cpu controller)."""


@dataclass(frozen=True)
class CgroupsUnavailable:
    """No cgroup hierarchy can hold sandboxes here; `reason` says why for each layout tried."""

    reason: str
    hint: str = (
        "run the reward worker as root on a host with cgroup v2 (memory and pids delegated to its "
        "cgroup) or cgroup v1 memory and pids hierarchies mounted read-write under /sys/fs/cgroup"
    )

    def __str__(self) -> str:
        return f"{self.reason} ({self.hint})"


# ------------------------------------------------------------------ reading what the kernel says


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo: where a filesystem is mounted and which part of it."""

    mount_point: str
    root: str
    """The path inside the filesystem that appears at `mount_point` (`/` unless it is a bind mount or
    a cgroup namespace shows only part of the tree)."""
    fstype: str
    super_options: frozenset[str]
    """For a cgroup v1 mount these name its controllers (`rw,cpu,cpuacct`)."""


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        dash = fields.index("-")
        if len(fields) < dash + 4:
            continue
        mounts.append(
            Mount(
                mount_point=_unescape(fields[4]),
                root=_unescape(fields[3]),
                fstype=fields[dash + 1],
                super_options=frozenset(fields[dash + 3].split(",")),
            )
        )
    return mounts


@dataclass(frozen=True)
class ProcCgroups:
    """/proc/<pid>/cgroup: the process's cgroup in the unified tree and in each v1 controller's tree."""

    unified: str | None
    """The `0::` line's path (None without cgroup v2)."""
    v1: dict[str, str]
    """v1 controller -> path (co-mounted controllers, `cpu,cpuacct`, each get the same path)."""


def parse_proc_cgroup(text: str) -> ProcCgroups:
    unified, v1 = None, {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy_id, controllers, path = parts
        if hierarchy_id == "0" and controllers == "":
            unified = path
        else:
            for controller in controllers.split(","):
                if controller:
                    v1[controller] = path
    return ProcCgroups(unified=unified, v1=v1)


def cgroup_dir(mount: Mount, path: str) -> Path | None:
    """Where cgroup `path` (as /proc/self/cgroup names it) is under `mount`; None if the mount does not
    show it (it shows only the subtree at `mount.root`)."""
    root = mount.root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    rest = path[len(root) :].strip("/")
    return Path(mount.mount_point) / rest if rest else Path(mount.mount_point)


def parse_keyed(text: str) -> dict[str, int]:
    """`key value` lines (memory.events, cpu.stat, pids.events, v1 memory.oom_control)."""
    values = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            values[parts[0]] = int(parts[1])
    return values


def _optional_int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None


def usage_v2(
    memory_events: str, memory_peak: str | None, pids_events: str, pids_peak: str | None, cpu_stat: str
) -> CgroupUsage:
    """A v2 sandbox's usage from its files' contents (a missing file as None)."""
    memory, pids, cpu = parse_keyed(memory_events), parse_keyed(pids_events), parse_keyed(cpu_stat)
    return CgroupUsage(
        oom_kills=memory.get("oom_kill", 0),
        memory_limit_hits=memory.get("max", 0),
        memory_peak_bytes=_optional_int(memory_peak),
        pids_limited=pids.get("max", 0) > 0,
        pids_peak=_optional_int(pids_peak),
        cpu_seconds=cpu["usage_usec"] / 1e6 if "usage_usec" in cpu else None,
        # nr_throttled is in cpu.stat only where the cpu controller is enabled.
        cpu_throttled_periods=cpu.get("nr_throttled"),
    )


def usage_v1(
    oom_control: str,
    failcnts: Iterable[str | None],
    max_usage: str | None,
    pids_events: str,
    pids_peak: str | None,
    cpuacct_usage_ns: str | None,
    cpu_stat: str | None,
) -> CgroupUsage:
    """A v1 sandbox's usage from its files' contents (a missing file as None)."""
    cpu_ns = _optional_int(cpuacct_usage_ns)
    return CgroupUsage(
        oom_kills=parse_keyed(oom_control).get("oom_kill", 0),
        memory_limit_hits=max((_optional_int(f) or 0 for f in failcnts), default=0),
        memory_peak_bytes=_optional_int(max_usage),
        pids_limited=parse_keyed(pids_events).get("max", 0) > 0,
        pids_peak=_optional_int(pids_peak),
        cpu_seconds=cpu_ns / 1e9 if cpu_ns is not None else None,
        cpu_throttled_periods=parse_keyed(cpu_stat).get("nr_throttled") if cpu_stat is not None else None,
    )


def cpu_quota_us(cpus: float) -> int:
    return max(_MIN_CPU_QUOTA_US, round(cpus * CPU_PERIOD_US))


def parent_owner_pid(name: str) -> int | None:
    """The pid a pool parent's name carries (None: not a pool parent's name)."""
    match = _PARENT_NAME.match(name)
    return int(match.group(1)) if match else None


def _alive(pid: int) -> bool:
    """A zombie is dead here: a killed worker its supervisor has not reaped yet holds no cgroups."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _read(path: Path) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _write(path: Path, text: str) -> None:
    # One write(2) of the whole value: cgroup files take a value per write, never a partial one.
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _pids_in(procs_file: Path) -> set[int]:
    text = _read(procs_file)
    return {int(pid) for pid in text.split()} if text else set()


# ------------------------------------------------------------------ one sandbox


@dataclass(frozen=True)
class _Dir:
    """One directory of a cgroup (v1: one per hierarchy it spans) and the controllers it carries."""

    path: Path
    controllers: frozenset[str]


class SandboxCgroup:
    """One sandbox's cgroup: a directory in each hierarchy (one on v2)."""

    def __init__(self, version: int, name: str, dirs: tuple[_Dir, ...]):
        self.version = version
        self.name = name
        self._dirs = dirs
        self.procs_files: tuple[str, ...] = tuple(str(d.path / "cgroup.procs") for d in dirs)
        self._procs_files_b = tuple(os.fsencode(f) for f in self.procs_files)  # encoded now, not after fork

    def __repr__(self) -> str:
        return f"SandboxCgroup(v{self.version}, {', '.join(str(d.path) for d in self._dirs)})"

    def _dir(self, controller: str) -> Path | None:
        for d in self._dirs:
            if controller in d.controllers:
                return d.path
        return None

    def _file(self, controller: str, name: str) -> Path | None:
        where = self._dir(controller)
        return where / name if where is not None else None

    def _read(self, controller: str, name: str) -> str | None:
        path = self._file(controller, name)
        return _read(path) if path is not None else None

    def join_from_preexec(self) -> None:
        """Move the calling process into this cgroup: the `preexec_fn` of the sandbox's Popen (it runs in
        the child between fork and exec, as root). Only os.open/os.write: no logging, no locks. "0" is
        the writing process itself. If a write fails the OSError propagates, Popen raises, and the
        program never runs outside its cgroup."""
        for path in self._procs_files_b:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

    def procs(self) -> list[int]:
        """Processes in the sandbox (every hierarchy's, in case a join was cut short between two)."""
        pids: set[int] = set()
        for procs_file in self.procs_files:
            pids |= _pids_in(Path(procs_file))
        return sorted(pids)

    def set_limits(self, limits: CgroupLimits) -> None:
        if self.version == 2:
            self._set_v2(limits)
        else:
            self._set_v1(limits)

    def _set_v2(self, limits: CgroupLimits) -> None:
        (d,) = self._dirs
        _write(d.path / "memory.max", str(limits.memory_bytes))
        if (d.path / "memory.swap.max").exists():  # absent without swap accounting
            _write(d.path / "memory.swap.max", "0")
        _write(d.path / "pids.max", str(limits.pids))
        if (d.path / "cpu.max").exists():  # absent where the cpu controller could not be enabled
            _write(d.path / "cpu.max", f"{cpu_quota_us(limits.cpus)} {CPU_PERIOD_US}")

    def _set_v1(self, limits: CgroupLimits) -> None:
        memory = self._dir("memory")
        assert memory is not None
        limit, memsw = memory / "memory.limit_in_bytes", memory / "memory.memsw.limit_in_bytes"
        new = str(limits.memory_bytes)
        if not memsw.exists():  # no swap accounting: swap is not charged here at all
            _write(limit, new)
        elif limits.memory_bytes > int(_read(limit) or 0):
            # The kernel keeps memsw >= limit at every step (EINVAL otherwise): raising, memsw goes first.
            _write(memsw, new)
            _write(limit, new)
        else:
            _write(limit, new)
            _write(memsw, new)
        pids = self._file("pids", "pids.max")
        assert pids is not None
        _write(pids, str(limits.pids))
        if (cpu := self._dir("cpu")) is not None:
            _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(cpu_quota_us(limits.cpus)))

    def limits(self) -> CgroupLimits:
        """The limits in force, as the kernel reports them (memory rounded to pages, say; `cpus` is
        infinite where no CPU bandwidth limit is in force)."""
        if self.version == 2:
            memory = self._read("memory", "memory.max")
            cpu_max = (self._read("cpu", "cpu.max") or "max").split()
        else:
            memory = self._read("memory", "memory.limit_in_bytes")
            quota, period = self._read("cpu", "cpu.cfs_quota_us"), self._read("cpu", "cpu.cfs_period_us")
            cpu_max = [quota.strip(), period.strip()] if quota and period else ["max"]
        pids = self._read("pids", "pids.max")
        assert memory is not None and pids is not None
        unlimited = cpu_max[0] in ("max", "-1")
        return CgroupLimits(
            memory_bytes=int(memory),
            pids=int(pids),
            cpus=float("inf") if unlimited else int(cpu_max[0]) / int(cpu_max[1]),
        )

    def usage(self) -> CgroupUsage:
        if self.version == 2:
            return usage_v2(
                memory_events=self._read("memory", "memory.events") or "",
                memory_peak=self._read("memory", "memory.peak"),
                pids_events=self._read("pids", "pids.events") or "",
                pids_peak=self._read("pids", "pids.peak"),
                cpu_stat=_read(self._dirs[0].path / "cpu.stat") or "",  # in every v2 cgroup, cpu enabled or not
            )
        return usage_v1(
            oom_control=self._read("memory", "memory.oom_control") or "",
            failcnts=(self._read("memory", "memory.failcnt"), self._read("memory", "memory.memsw.failcnt")),
            max_usage=self._read("memory", "memory.max_usage_in_bytes"),
            pids_events=self._read("pids", "pids.events") or "",
            pids_peak=self._read("pids", "pids.peak"),
            cpuacct_usage_ns=self._read("cpuacct", "cpuacct.usage"),
            cpu_stat=self._read("cpu", "cpu.stat"),
        )

    # -------------------------------------------------------------- killing

    def _kill_listed(self, pids: Iterable[int]) -> None:
        """SIGKILL each pid that is still in the sandbox once we hold a pidfd for it, so that a pid that
        exited and was reused by someone else's process meanwhile is never signalled."""
        pidfds: dict[int, int] = {}
        try:
            for pid in pids:
                try:
                    pidfds[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    pass
                except OSError:  # no pidfds (kernel < 5.3): by pid, the reuse race accepted
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            members = set(self.procs())
            for pid, fd in pidfds.items():
                if pid in members:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            for fd in pidfds.values():
                os.close(fd)

    def _cgroup_kill(self) -> bool:
        """v2's cgroup.kill (kernel 5.14+): the kernel kills every task, forks in flight included."""
        if self.version != 2:
            return False
        kill = self._dirs[0].path / "cgroup.kill"
        if not kill.exists():
            return False
        _write(kill, "1")
        return True

    async def _freeze(self) -> bool:
        """Freeze every task so none forks while we kill (True once frozen; False: no freezer, or it did
        not settle in a few polls and the round kills anyway)."""
        if self.version == 2:
            path = self._dirs[0].path
            if not (path / "cgroup.freeze").exists():
                return False
            _write(path / "cgroup.freeze", "1")
            for _ in range(_FREEZE_POLLS):
                if parse_keyed(_read(path / "cgroup.events") or "").get("frozen") == 1:
                    return True
                await asyncio.sleep(0.005)
            return False
        state = self._file("freezer", "freezer.state")
        if state is None or not state.exists():
            return False
        for _ in range(_FREEZE_POLLS):
            _write(state, "FROZEN")  # written again while FREEZING: the v1 freezer retries stragglers
            if (_read(state) or "").strip() == "FROZEN":
                return True
            await asyncio.sleep(0.005)
        return False

    def _thaw(self) -> None:
        if self.version == 2:
            path = self._dirs[0].path / "cgroup.freeze"
            if path.exists():
                _write(path, "0")
        elif (state := self._file("freezer", "freezer.state")) is not None and state.exists():
            # v1 frozen tasks hold their SIGKILL until thawed: this is when they die.
            _write(state, "THAWED")

    async def kill_all(self) -> None:
        """SIGKILL every process in the sandbox, whatever sessions, groups or parents they have now, and
        return once none is left. No deadline: it returns when the kernel says the cgroup is empty,
        however loaded the machine (it logs while that takes long)."""
        started = warned = time.monotonic()
        delay = 0.001
        while pids := self.procs():
            if not self._cgroup_kill():
                await self._freeze()
                try:
                    self._kill_listed(self.procs())  # read again: forks before the freeze settled
                finally:
                    self._thaw()
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_S)
            if time.monotonic() - warned > _SLOW_KILL_WARNING_S:
                warned = time.monotonic()
                log.warning(
                    "sandbox processes still alive after SIGKILL",
                    cgroup=self.name,
                    pids=pids[:16],
                    waited_s=round(warned - started, 1),
                )

    async def remove(self) -> None:
        """Remove the cgroup in every hierarchy, killing whatever is still in it first. Retries EBUSY for
        a moment (a task that has just died can keep the cgroup busy until it is fully gone)."""
        if self.procs():
            await self.kill_all()
        for d in self._dirs:
            await _rmdir(d.path, self)


async def _rmdir(path: Path, sandbox: SandboxCgroup | None = None) -> None:
    delay = 0.001
    for _ in range(_RMDIR_BUSY_TRIES):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
        if sandbox is not None and sandbox.procs():
            await sandbox.kill_all()
        await asyncio.sleep(delay)
        delay = min(delay * 2, _MAX_POLL_S)
    raise OSError(errno.EBUSY, f"cgroup {path} stayed busy with no process left in it", str(path))


# ------------------------------------------------------------------ the pool's parent


@dataclass(frozen=True)
class _Base:
    """Where pool parents go in one hierarchy: under this process's cgroup (v2: or the nearest
    ancestor that works), with the controllers that hierarchy gives sandboxes."""

    path: Path
    controllers: frozenset[str]


class CgroupHierarchy:
    """This pool's parent cgroup (in each hierarchy, on v1) and the sandboxes made under it."""

    def __init__(self, version: int, owner: str, bases: tuple[_Base, ...], parent_name: str):
        self.version = version
        self.owner = owner
        self._bases = bases
        self.parent_name = parent_name
        self.controllers: frozenset[str] = frozenset().union(*(b.controllers for b in bases))
        """What sandboxes are limited and measured by: memory and pids always; cpu when its bandwidth
        limit is in force; v1 cpuacct (CPU time) and freezer (race-free kills) where mounted."""

    @property
    def parents(self) -> tuple[Path, ...]:
        return tuple(b.path / self.parent_name for b in self._bases)

    def __repr__(self) -> str:
        return f"CgroupHierarchy(v{self.version}, {', '.join(str(p) for p in self.parents)})"

    def _sandbox(self, parent_name: str, name: str) -> SandboxCgroup:
        dirs = tuple(_Dir(b.path / parent_name / name, b.controllers) for b in self._bases)
        return SandboxCgroup(self.version, name, dirs)

    def create(self, name: str, limits: CgroupLimits) -> SandboxCgroup:
        """A fresh cgroup for one sandbox, limits set, nothing in it yet. Raises OSError (FileExistsError
        for a name in use) with nothing left behind."""
        if not _SANDBOX_NAME.match(name):
            raise ValueError(f"{name!r} is not a sandbox cgroup name (letters, digits, '_', '.', '-')")
        sandbox = self._sandbox(self.parent_name, name)
        made: list[Path] = []
        try:
            for d in sandbox._dirs:
                os.mkdir(d.path)
                made.append(d.path)
            sandbox.set_limits(limits)
        except BaseException:
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise
        return sandbox

    async def _remove_parent(self, parent_name: str) -> int:
        """Kill and remove every sandbox under one parent, then the parent; returns how many sandboxes."""
        names: set[str] = set()
        for base in self._bases:
            with contextlib.suppress(FileNotFoundError), os.scandir(base.path / parent_name) as entries:
                names.update(entry.name for entry in entries if entry.is_dir(follow_symlinks=False))
        for name in sorted(names):
            await self._sandbox(parent_name, name).remove()
        for base in self._bases:
            await _rmdir(base.path / parent_name)
        return len(names)

    def _foreign(self, parent_name: str) -> bool:
        """A parent holding processes outside our pid namespace (listed as pid 0) belongs to a worker we
        cannot see, not to a dead one."""
        for base in self._bases:
            with contextlib.suppress(FileNotFoundError), os.scandir(base.path / parent_name) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False) and 0 in _pids_in(Path(entry.path) / "cgroup.procs"):
                        return True
        return False

    async def sweep_stale(self) -> int:
        """Remove the parents left by pools whose process is dead (killing what is still in them); returns
        how many. Only parents beside ours are looked at, and a parent whose pid is alive is left alone
        (after a pid is reused, until that process ends too)."""
        stale: set[str] = set()
        for base in self._bases:
            with contextlib.suppress(FileNotFoundError), os.scandir(base.path) as entries:
                for entry in entries:
                    pid = parent_owner_pid(entry.name)
                    if pid is not None and entry.name != self.parent_name and not _alive(pid):
                        stale.add(entry.name)
        removed = 0
        for parent_name in sorted(stale):
            if self._foreign(parent_name):
                log.warning("left a sandbox cgroup parent of another pid namespace alone", parent=parent_name)
                continue
            try:
                sandboxes = await self._remove_parent(parent_name)
            except OSError as exc:  # one parent we cannot remove must not keep the others
                log.error("could not remove a dead pool's sandbox cgroups", parent=parent_name, error=repr(exc))
                continue
            removed += 1
            log.warning(
                "removed the sandbox cgroups of a dead pool", owner=self.owner, parent=parent_name, sandboxes=sandboxes
            )
        return removed

    async def close(self) -> None:
        """Remove this pool's parent; sandboxes still under it are killed and removed first."""
        left = await self._remove_parent(self.parent_name)
        if left:
            log.warning("sandbox cgroups were still open at close", owner=self.owner, sandboxes=left)


# ------------------------------------------------------------------ finding a usable hierarchy


def _controllers(path: Path) -> set[str]:
    return set((_read(path / "cgroup.controllers") or "").split())


def _enable(path: Path, controllers: Iterable[str]) -> str | None:
    """Enable `controllers` for the children of `path` (None) or say why not."""
    try:
        _write(path / "cgroup.subtree_control", " ".join(f"+{c}" for c in controllers))
    except OSError as exc:
        return f"cannot enable {', '.join(controllers)} in {path}/cgroup.subtree_control: {exc.strerror}"
    return None


def _new_parent_v2(base: Path, parent_name: str) -> tuple[Path, frozenset[str]] | str:
    """Make the pool's parent under `base` with memory, pids (and cpu when possible) enabled for its
    children; the parent itself holds no process, so the no-internal-process rule cannot refuse it."""
    parent = base / parent_name
    try:
        os.mkdir(parent)
    except OSError as exc:
        return f"cannot create {parent}: {exc.strerror}"
    available = _controllers(parent)
    missing = [c for c in REQUIRED_CONTROLLERS if c not in available]
    why = (
        f"{', '.join(missing)} not available in {parent} (cgroup.controllers: {' '.join(sorted(available)) or '-'})"
        if missing
        else _enable(parent, REQUIRED_CONTROLLERS)
    )
    if why is not None:
        with contextlib.suppress(OSError):
            os.rmdir(parent)
        return why
    enabled = {*REQUIRED_CONTROLLERS}
    if "cpu" in available and _enable(parent, ["cpu"]) is None:  # optional: refused with realtime tasks, say
        enabled.add("cpu")
    return parent, frozenset(enabled)


def open_v2(mounts: list[Mount], proc: ProcCgroups, parent_name: str) -> _Base | str:
    """Create the pool's parent on cgroup v2; returns where, or why v2 cannot be used here.

    Under this process's own cgroup when memory and pids can be enabled for its children. Usually they
    cannot: a non-root cgroup that holds processes (ours holds us) may not enable controllers for
    children (EBUSY, the no-internal-process rule). Then beside it, in its parent, which necessarily has
    them enabled if our cgroup has them at all: the delegation root's child, for a service delegated a
    subtree. Moving ourselves into a leaf would free our own cgroup, but would move other processes'
    accounting too: not done."""
    if proc.unified is None:
        return "this process is in no cgroup v2 (/proc/self/cgroup has no 0:: line)"
    candidates = [m for m in mounts if m.fstype == "cgroup2" and cgroup_dir(m, proc.unified) is not None]
    if not candidates:
        return f"no cgroup2 mount shows this process's cgroup {proc.unified}"
    mount = candidates[0]
    own = cgroup_dir(mount, proc.unified)
    assert own is not None
    available = _controllers(own)
    missing = [c for c in REQUIRED_CONTROLLERS if c not in available]
    if missing:
        return (
            f"cgroup2 at {mount.mount_point}: {', '.join(missing)} not available to this process's cgroup "
            f"{proc.unified} (cgroup.controllers: {' '.join(sorted(available)) or '-'})"
        )
    wanted = [c for c in (*REQUIRED_CONTROLLERS, "cpu") if c in available]
    enabled = set((_read(own / "cgroup.subtree_control") or "").split())
    why_not_own = None
    if not set(REQUIRED_CONTROLLERS) <= enabled:
        why_not_own = _enable(own, wanted)
        if why_not_own is not None and "cpu" in wanted:
            why_not_own = _enable(own, REQUIRED_CONTROLLERS)
    reasons = []
    if why_not_own is None:
        made = _new_parent_v2(own, parent_name)
        if not isinstance(made, str):
            return _Base(own, made[1])
        reasons.append(made)
    else:
        reasons.append(why_not_own)
    if own != Path(mount.mount_point):
        made = _new_parent_v2(own.parent, parent_name)
        if not isinstance(made, str):
            log.info("sandbox cgroups go beside this process's own cgroup", own=str(own), why=reasons[0])
            return _Base(own.parent, made[1])
        reasons.append(made)
    else:
        reasons.append(f"{own} is the top of the cgroup tree this process can see: nothing beside it to use")
    return "cgroup v2: " + "; ".join(reasons)


def open_v1(mounts: list[Mount], proc: ProcCgroups, parent_name: str) -> tuple[_Base, ...] | str:
    """Create the pool's parent in each v1 hierarchy we use; returns where, or why v1 cannot be used."""
    dirs: dict[Path, set[str]] = {}
    for controller in _V1_CONTROLLERS:
        mount = next((m for m in mounts if m.fstype == "cgroup" and controller in m.super_options), None)
        path = proc.v1.get(controller)
        if mount is None or path is None:
            continue
        where = cgroup_dir(mount, path)
        if where is not None:
            dirs.setdefault(where, set()).add(controller)
    found = set().union(*dirs.values()) if dirs else set()
    missing = [c for c in REQUIRED_CONTROLLERS if c not in found]
    if missing:
        return f"cgroup v1: no {', '.join(missing)} hierarchy mounted (with this process's cgroup in it)"
    made: list[Path] = []
    for where in dirs:
        try:
            os.mkdir(where / parent_name)
        except OSError as exc:
            for path in made:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            return f"cgroup v1: cannot create {where / parent_name}: {exc.strerror}"
        made.append(where / parent_name)
    return tuple(_Base(where, frozenset(controllers)) for where, controllers in dirs.items())


def open_cgroups(owner: str, *, owner_pid: int | None = None) -> CgroupHierarchy | CgroupsUnavailable:
    """This pool's parent cgroup, on v2 if usable, else v1; or why neither can be used (never raises for
    that). `owner` names the pool in logs; `owner_pid` (default: this process) is the pid in the parent's
    name, whose death lets another pool's `sweep_stale` remove it."""
    pid = os.getpid() if owner_pid is None else owner_pid
    parent_name = f"{PARENT_PREFIX}{pid}-{secrets.token_hex(4)}"
    mounts = parse_mountinfo(_read(Path("/proc/self/mountinfo")) or "")
    proc = parse_proc_cgroup(_read(Path("/proc/self/cgroup")) or "")
    v2 = open_v2(mounts, proc, parent_name)
    if isinstance(v2, _Base):
        hierarchy = CgroupHierarchy(2, owner, (v2,), parent_name)
    else:
        v1 = open_v1(mounts, proc, parent_name)
        if isinstance(v1, str):
            return CgroupsUnavailable(f"{v2}; {v1}")
        hierarchy = CgroupHierarchy(1, owner, v1, parent_name)
        log.info("sandbox cgroups use cgroup v1", owner=owner, why_not_v2=v2)
    if "cpu" not in hierarchy.controllers:
        log.warning("sandbox cgroups have no cpu controller: CPU bandwidth is not limited", owner=owner)
    log.info(
        "sandbox cgroups ready",
        owner=owner,
        version=hierarchy.version,
        controllers=sorted(hierarchy.controllers),
        parents=[str(p) for p in hierarchy.parents],
    )
    return hierarchy
