"""A private network lab on one machine: a "hub" network namespace (the stack and the trainer) and
"island" namespaces (workers on other networks), each island joined to the hub by its own veth pair
and shaped by `tc tbf`, so tests and benchmarks cross real network boundaries without a second host.

Layout. Island number i (0, 1, ...) gets the subnet 10.201.<i+1>.0/24: the hub's end is .1, the
island's end is .2. The same subnets are reused by every lab: they exist only inside the lab's own
namespaces, and nothing is added to the root namespace's links, addresses or routes (the veth pairs are
created directly inside the namespaces, so veth names need only be unique within one namespace; that
is why they are short and fixed: `isl<i>` in the hub, `hub0` in the island). An island has a route to
its own /24 only and the hub does not forward, so an island reaches the hub's address on its own link
and nothing else: not another island, not the root namespace, not the internet.

Shaping. Each link gets `tbf` on both ends (the hub's end caps the island's downloads, the island's
end its uploads). tbf shapes bandwidth only. This kernel has no `netem`, so there is no latency
emulation: tbf's `latency` bounds how long a packet may queue behind the bucket (it sizes the queue),
it adds no propagation delay. Where a round-trip time matters, model it rather than emulate it:
time ≈ bytes / rate + round_trips x RTT, with round_trips counted from the protocol (1 for a request
on an open connection, +1 for a TCP connect, +1..2 for a TLS handshake); or put a userspace relay in
the hub that holds each chunk for RTT/2 before forwarding it.

Names. Namespaces are `sprawl-<pid>-<counter>-hub` and `sprawl-<pid>-<counter>-<island>`, so labs of
several processes (four copies of the test suite) never collide, and `sweep_stale()` (run at every
lab start) deletes the labs of a creator that died without closing them (a SIGKILLed test run).

Root is required; `lab_unavailable()` says why a lab cannot run here, for a skip or a benchmark's
message.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from pipeline.errors import SprawlError

NAME_PREFIX = "sprawl-"
_LAB_NAMESPACE = re.compile(r"^sprawl-(?P<pid>\d+)-(?P<counter>\d+)-(?P<role>[a-z0-9-]+)$")
_ISLAND_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
HUB_ROLE = "hub"
ISLAND_VETH = "hub0"
"""The island's end of its link (names are per namespace, so every island can use the same one)."""

COMMAND_TIMEOUT_S = 15.0
"""Per `ip`/`tc` command. They answer in milliseconds; this only guards against a wedged kernel or tool."""

BURST_FLOOR_BYTES = 32 * 1024
"""A floor of about 21 full-size frames: tbf drops any packet larger than its bucket, and veth hands it
segmentation-offloaded packets of tens of KiB, which tbf then splits; a bucket of a few MTUs keeps a
slow link from dropping every other frame."""

KERNEL_HZ_FLOOR = 100
"""tbf's bucket must hold at least rate/HZ bytes or it cannot reach its rate (it refills once per tick
on older timers). HZ is 100..1000 depending on the kernel's config; sizing for the lowest is safe on all."""

_counter = itertools.count()


class NetworkLabError(SprawlError):
    """An `ip` or `tc` command failed (or did not answer); carries the command and its stderr."""

    def __init__(self, command: Sequence[str], detail: str):
        self.command = list(command)
        self.stderr = detail.strip()
        super().__init__(
            f"`{' '.join(self.command)}` failed: {self.stderr or '(no output)'}",
            hint="network labs need root, iproute2, and a kernel with network namespaces, veth and sch_tbf; "
            "infra.netns.lab_unavailable() says which is missing",
        )


@dataclass
class Island:
    """One island: its namespace, its address, and the hub's address as the island sees it."""

    name: str
    namespace: str
    address: str
    hub_addr: str
    veth: str
    """The island's end of the link (in `namespace`)."""
    hub_veth: str
    """The hub's end of the link (in the hub namespace)."""
    rate_mbit: float | None
    queue_latency_ms: float


def burst_bytes(rate_mbit: float) -> int:
    """The tbf bucket for a rate: 1/HZ of a second of traffic at the lowest HZ (10 ms), but never less
    than BURST_FLOOR_BYTES. Larger buckets let more bytes through at line speed before shaping starts
    (10 ms worth, which a transfer of more than a second barely notices)."""
    return max(math.ceil(rate_mbit * 1e6 / 8 / KERNEL_HZ_FLOOR), BURST_FLOOR_BYTES)


def argv_in(namespace: str, argv: Sequence[str]) -> list[str]:
    """`argv` run inside `namespace` (`ip netns exec` joins it, then execs argv: the pid is argv's)."""
    return ["ip", "netns", "exec", namespace, *argv]


def _run(argv: Sequence[str], *, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise NetworkLabError(argv, f"no answer within {timeout_s:g}s") from exc
    except OSError as exc:  # the program itself is missing or not executable
        raise NetworkLabError(argv, str(exc)) from exc
    if done.returncode != 0:
        raise NetworkLabError(argv, f"exit {done.returncode}: {done.stderr}")
    return done.stdout


def list_namespaces() -> list[str]:
    """Every named network namespace on the machine (`ip netns list`: "name" or "name (id: N)")."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    """Processes whose network namespace is `namespace` (exited ones are no longer in any)."""
    return [int(pid) for pid in _run(["ip", "netns", "pids", namespace]).split()]


def _pid_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for a parent that is not us to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Poll until the pids have exited (they are not our children, so they cannot be waited for);
    returns those still running at the deadline."""
    remaining = list(pids)
    deadline = time.monotonic() + timeout_s
    while remaining:
        remaining = [pid for pid in remaining if not _pid_gone(pid)]
        if not remaining or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return remaining


def _kill_namespace_processes(namespace: str, grace_s: float) -> None:
    """SIGTERM everything inside the namespace, SIGKILL what outlives the grace period. A namespace
    outlives `ip netns del` while any process is inside it, so this comes before every delete."""
    pids = namespace_pids(namespace)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    for pid in _wait_gone(pids, grace_s):
        _signal(pid, signal.SIGKILL)
    # Whatever forked during the grace period is caught here, straight to SIGKILL.
    late = namespace_pids(namespace)
    for pid in late:
        _signal(pid, signal.SIGKILL)
    _wait_gone(pids + late, COMMAND_TIMEOUT_S)


def _delete_namespaces(namespaces: Iterable[str], grace_s: float) -> NetworkLabError | None:
    """Kill the processes inside, then delete each namespace that still exists (its veth ends go with
    it, and a veth's peer goes with its end). Tries them all; returns the first failure."""
    first_error: NetworkLabError | None = None
    existing = set(list_namespaces())
    for namespace in namespaces:
        if namespace not in existing:
            continue
        try:
            _kill_namespace_processes(namespace, grace_s)
            _run(["ip", "netns", "delete", namespace])
        except NetworkLabError as exc:
            first_error = first_error or exc
    return first_error


def _creator_dead(pid: int) -> bool:
    # A pid reused by another process since keeps its lab until that one exits too: never deletes a live lab.
    return _pid_gone(pid)


def sweep_stale() -> list[str]:
    """Delete the namespaces of labs whose creating process is dead (a SIGKILLed test run leaves its lab
    behind), killing what still runs inside them. Returns the namespaces deleted. Safe to run from
    several processes at once: a namespace another sweeper deleted first is skipped."""
    stale = []
    for namespace in list_namespaces():
        match = _LAB_NAMESPACE.match(namespace)
        if match and _creator_dead(int(match["pid"])):
            stale.append(namespace)
    # Islands first: the hub holds their peers, and a sweeper racing us then finds whole labs, not halves.
    stale.sort(key=lambda name: name.endswith(f"-{HUB_ROLE}"))
    swept = []
    for namespace in stale:
        if _delete_namespaces([namespace], grace_s=1.0) is None and namespace not in list_namespaces():
            swept.append(namespace)
    return swept


@functools.cache
def lab_unavailable() -> str | None:
    """Why a network lab cannot run here, or None if it can: checked by doing what a lab does (a probe
    namespace with a veth pair shaped by tbf), then deleting it."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not on PATH"
    probe = f"{NAME_PREFIX}{os.getpid()}-{next(_counter)}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except NetworkLabError as exc:
        return f"cannot create a network namespace: {exc.message}"
    try:
        _run(["ip", "-n", probe, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1"])
        _run(["tc", "-n", probe, "qdisc", "replace", "dev", "probe0", "root", *_tbf_args(10.0, 50.0)])
    except NetworkLabError as exc:
        return f"cannot create a veth pair shaped by tbf in a namespace: {exc.message}"
    finally:
        with contextlib.suppress(NetworkLabError):
            _run(["ip", "netns", "delete", probe])
    return None


def _tbf_args(rate_mbit: float, queue_latency_ms: float) -> list[str]:
    rate_bit = round(rate_mbit * 1e6)
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst_bytes(rate_mbit)), "latency", f"{queue_latency_ms:g}ms"]


class NetworkLab:
    """A hub namespace and island namespaces joined to it by shaped veth links. Use as a context manager,
    or call `start()` and `close()`. Everything it creates (namespaces, links, processes spawned in it or
    running inside it) is gone after `close()`, and after a failed `start()`."""

    def __init__(self, *, stop_grace_s: float = 2.0):
        self.stop_grace_s = stop_grace_s
        """How long a process gets between SIGTERM and SIGKILL when the lab closes."""
        self.lab_id = f"{NAME_PREFIX}{os.getpid()}-{next(_counter)}"
        self.hub = f"{self.lab_id}-{HUB_ROLE}"
        """The hub's namespace: where the stack and the trainer run."""
        self.islands: dict[str, Island] = {}
        self._processes: list[subprocess.Popen[Any]] = []
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> NetworkLab:
        if self._closed:
            raise RuntimeError(f"lab {self.lab_id} is closed; make a new one")
        if self._started:
            return self
        sweep_stale()
        self._started = True
        try:
            _run(["ip", "netns", "add", self.hub])
            self._setup_namespace(self.hub)
            # A new namespace does not forward by default; say so anyway, so islands never reach each other
            # through the hub whatever the machine's defaults are.
            self._write_sysctls(self.hub, {"net/ipv4/ip_forward": "0", "net/ipv6/conf/all/forwarding": "0"})
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process of the lab (SIGTERM, then SIGKILL after `stop_grace_s`), then delete its
        namespaces. Idempotent; raises the first failure after trying everything."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        self._stop_spawned()
        namespaces = [island.namespace for island in self.islands.values()] + [self.hub]
        error = _delete_namespaces(namespaces, self.stop_grace_s)
        if error is not None:
            raise error

    def __enter__(self) -> NetworkLab:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ islands and links

    def add_island(self, name: str, rate_mbit: float | None, *, queue_latency_ms: float = 50.0) -> Island:
        """A new namespace joined to the hub by its own link, shaped to `rate_mbit` both ways (None:
        unshaped, veth speed). `queue_latency_ms` is tbf's queue bound (see the module docstring: it is
        not a propagation delay). On failure the island's namespace (and so its link) is removed."""
        self._require_running()
        if not _ISLAND_NAME.match(name) or name == HUB_ROLE:
            raise ValueError(f"island name {name!r}: use 1-32 of [a-z0-9-], starting with a letter or digit, not 'hub'")
        if name in self.islands:
            raise ValueError(f"island {name!r} already exists in lab {self.lab_id}")
        _check_rate(rate_mbit)
        index = len(self.islands)
        if index >= 254:
            raise ValueError("a lab holds at most 254 islands (one 10.201.<n>.0/24 each)")
        island = Island(
            name=name,
            namespace=f"{self.lab_id}-{name}",
            address=f"10.201.{index + 1}.2",
            hub_addr=f"10.201.{index + 1}.1",
            veth=ISLAND_VETH,
            hub_veth=f"isl{index}",
            rate_mbit=None,
            queue_latency_ms=queue_latency_ms,
        )
        _run(["ip", "netns", "add", island.namespace])
        try:
            self._setup_namespace(island.namespace)
            # Made inside the hub with its peer placed straight into the island: never in the root namespace.
            hub_end = ["ip", "-n", self.hub, "link", "add", "name", island.hub_veth, "type", "veth"]
            _run([*hub_end, "peer", "name", island.veth, "netns", island.namespace])
            _run(["ip", "-n", self.hub, "addr", "add", f"{island.hub_addr}/24", "dev", island.hub_veth])
            _run(["ip", "-n", island.namespace, "addr", "add", f"{island.address}/24", "dev", island.veth])
            _run(["ip", "-n", island.namespace, "link", "set", island.veth, "up"])
            _run(["ip", "-n", self.hub, "link", "set", island.hub_veth, "up"])
            self._shape(island, rate_mbit)
        except BaseException:
            with contextlib.suppress(NetworkLabError):
                _delete_namespaces([island.namespace], self.stop_grace_s)
            raise
        self.islands[name] = island
        return island

    def set_rate(self, island: Island | str, rate_mbit: float | None) -> None:
        """Change a live link's rate, both ways (None: remove the shaping). Open connections keep going."""
        self._require_running()
        _check_rate(rate_mbit)
        self._shape(self._island(island), rate_mbit)

    def _shape(self, island: Island, rate_mbit: float | None) -> None:
        ends = [(self.hub, island.hub_veth), (island.namespace, island.veth)]
        for namespace, dev in ends:
            if rate_mbit is not None:
                tbf = _tbf_args(rate_mbit, island.queue_latency_ms)
                _run(["tc", "-n", namespace, "qdisc", "replace", "dev", dev, "root", *tbf])
            elif island.rate_mbit is not None:  # deleting the default qdisc would fail: only ours
                _run(["tc", "-n", namespace, "qdisc", "delete", "dev", dev, "root"])
        island.rate_mbit = rate_mbit

    # ------------------------------------------------------------------ processes

    def argv_in(self, where: Island | str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the hub or an island (an Island, or a namespace name such as `lab.hub`)."""
        return argv_in(self._namespace(where), argv)

    def spawn_in(self, where: Island | str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside the hub or an island; `close()` stops it (by pid) and reaps it."""
        self._require_running()
        process = subprocess.Popen(self.argv_in(where, argv), **popen_kwargs)
        self._processes.append(process)
        return process

    def _stop_spawned(self) -> None:
        running = [process for process in self._processes if process.poll() is None]
        for process in running:
            _signal(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(process.pid, signal.SIGKILL)
        for process in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=COMMAND_TIMEOUT_S)  # reaped: no zombie left behind

    # ------------------------------------------------------------------ helpers

    def _setup_namespace(self, namespace: str) -> None:
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def _write_sysctls(self, namespace: str, values: dict[str, str]) -> None:
        # /proc/sys/net shows the namespace of the process that opens it, so the write runs inside.
        # Python rather than `sysctl`: procps is not guaranteed, this interpreter is.
        script = "import sys\nfor key, value in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        script += "    open('/proc/sys/' + key, 'w').write(value)\n"
        pairs = [item for key_value in values.items() for item in key_value]
        _run(argv_in(namespace, [sys.executable, "-c", script, *pairs]))

    def _island(self, island: Island | str) -> Island:
        name = island.name if isinstance(island, Island) else island
        if name not in self.islands:
            raise KeyError(f"no island {name!r} in lab {self.lab_id} (islands: {', '.join(self.islands) or 'none'})")
        return self.islands[name]

    def _namespace(self, where: Island | str) -> str:
        if isinstance(where, Island):
            return self._island(where).namespace
        if where != self.hub and where not in {island.namespace for island in self.islands.values()}:
            raise KeyError(f"{where!r} is not a namespace of lab {self.lab_id}")
        return where

    def _require_running(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError(f"lab {self.lab_id} is not running (start() it, or make a new one)")


def _check_rate(rate_mbit: float | None) -> None:
    if rate_mbit is not None and not (rate_mbit > 0 and math.isfinite(rate_mbit)):
        raise ValueError(f"rate_mbit must be a positive number of Mbit/s or None, not {rate_mbit!r}")
