"""Helpers for tests that run real servers: a stack under a temp state dir, on ports nobody can steal.

`start_stack` is the race-free way: the stack is configured with port 0 everywhere, nats-server
binds a port the kernel picks (and reports it), SeaweedFS is started again on another block if one
of its ports is taken before it binds, and the settings returned point at what is actually running.
Stop it with `stack.down(settings)`, by the pids recorded under its state dir.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import tempfile
import time
import uuid
from pathlib import Path

from infra import stack
from infra.stack import StackError, StackSection, StackSettings
from pipeline.config import LogSettings, NatsSettings, S3BlobSettings, StreamSettings

# Short timers so redelivery happens within a test, not after 30 s.
TEST_STREAMS = StreamSettings(ack_wait_s=2.0, backoff_s=[2.0, 2.0, 2.0], max_deliver=4, duplicate_window_s=120.0)

HANG_GUARD_S = 900.0
"""The bound on waiting for something a test awaits (a trajectory, a drained consumer): it only turns a
hang into a failure, so it is far above what four suites on two cores ever need. Never a timing check."""

START_TIMEOUT_S = 180.0
"""A hang guard for server start-up, generous because four suites may be starting stacks on two cores."""


def auto_stack_settings(state_dir: Path, run_id: str = "test", **ports: int) -> StackSettings:
    """Settings for a stack whose ports are chosen as it starts (0), except those given in `ports`.
    Its endpoints are known once it runs: `stack.with_endpoints(settings, stack.up(settings))`."""
    section = StackSection(
        **{"nats_port": 0, "nats_monitor_port": 0, "s3_port": 0, "seaweed_port_base": 0, **ports},
        start_timeout_s=START_TIMEOUT_S,
    )
    return StackSettings(
        run_id=run_id,
        state_dir=state_dir,
        log_format="json",
        stack=section,
        log=LogSettings(publish_attempts=4, publish_backoff_s=0.1),
        streams=TEST_STREAMS,
    )


@contextlib.contextmanager
def running_cluster(state_dir: Path, run_id: str):
    """A 3-node log cluster (and SeaweedFS) on free ports; the settings yielded point at it."""
    settings = auto_stack_settings(state_dir, run_id, nats_cluster=3, nats_cluster_port=0)
    running = stack.up(settings)
    try:
        yield stack.with_endpoints(settings, running)
    finally:
        stack.down(settings)


def start_stack(state_dir: Path, run_id: str = "test") -> StackSettings:
    """Start a stack on free ports; the settings returned point at it."""
    settings = auto_stack_settings(state_dir, run_id)
    return stack.with_endpoints(settings, stack.up(settings))


# Fixed ports are drawn from ranges no automatic choice uses: not the kernel's ephemeral ports (32768+,
# which nats-server's port -1 and every outgoing connection get), not infra.stack's automatic SeaweedFS
# blocks (2000-9997 and 12007-19996). That narrows their race to other fixed-port users.
_FIXED_PORTS = range(22010, 30000)
_FIXED_SEAWEED_BASES = range(10000, 12000)  # base..base+8 and base+10007 (20007-22006)


_PORT_LOCKS = Path(tempfile.gettempdir()) / "sprawl-test-ports"
_held_port_locks: list = []  # open lock files: a port stays reserved for as long as this test process lives


def free_port() -> int:
    """A port free at this moment, and reserved for this process: an flock on a per-port file keeps
    every other test process (parallel suites) from choosing it, even while our server is down on
    purpose (a restart or outage test) and the port looks free. Still racy against processes that do
    not take the lock: prefer `start_stack`."""
    _PORT_LOCKS.mkdir(exist_ok=True)
    for _ in range(200):
        port = random.choice(_FIXED_PORTS)
        lock = open(_PORT_LOCKS / f"{port}.lock", "a+")  # noqa: SIM115 - held open on purpose
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        if stack.port_is_free(port):
            _held_port_locks.append(lock)
            return port
        lock.close()
    raise RuntimeError("no free port found")


def free_seaweed_base() -> int:
    """A base whose 8 ports and the admin gRPC port (admin + 10000) are free at this moment. Racy, as
    `free_port`."""
    for _ in range(200):
        base = random.choice(_FIXED_SEAWEED_BASES)
        ports = [*range(base, base + 8), base + 7 + 10000]
        if all(stack.port_is_free(p) for p in ports):
            return base
    raise RuntimeError("no free SeaweedFS port block found")


def stack_settings(state_dir: Path, run_id: str = "test") -> StackSettings:
    """Fixed ports chosen now, for tests that need to know them before the stack starts (a `sprawl up`
    subprocess, a restart on the same ports). Racy, as `free_port`: prefer `start_stack`."""
    section = StackSection(
        nats_port=free_port(),
        nats_monitor_port=free_port(),
        s3_port=free_port(),
        seaweed_port_base=free_seaweed_base(),
        start_timeout_s=START_TIMEOUT_S,
    )
    return StackSettings(
        run_id=run_id,
        state_dir=state_dir,
        log_format="json",
        stack=section,
        nats=NatsSettings(url=f"nats://127.0.0.1:{section.nats_port}"),
        blobs=S3BlobSettings(endpoint_url=f"http://127.0.0.1:{section.s3_port}"),
        log=LogSettings(publish_attempts=4, publish_backoff_s=0.1),
        streams=TEST_STREAMS,
    )


def new_run_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def restartable_stack(tmp_path: Path, *, monitor_port_fixed: bool = False):
    """A stack of our own whose nats-server a test kills and starts again on the same port(s), so those
    ports are fixed (`free_port`: reserved across test processes); everything else binds a free port.
    A fixed port taken meanwhile is retried with another. Its run id is its own: a client that strays
    onto another suite's server on a reused port finds nothing of its run and fails loudly, instead of
    training that suite's identical groups."""
    for attempt in range(5):
        ports = {"nats_port": free_port(), **({"nats_monitor_port": free_port()} if monitor_port_fixed else {})}
        settings = auto_stack_settings(tmp_path / f"state{attempt}", run_id=f"t{uuid.uuid4().hex[:10]}", **ports)
        try:
            settings = stack.with_endpoints(settings, stack.up(settings))
            break
        except StackError as exc:
            if "already in use" not in str(exc) and "exited during start-up" not in str(exc):
                raise
    else:
        raise AssertionError("no free fixed ports for nats-server in 5 attempts")
    try:
        yield settings
    finally:
        stack.down(settings)


@contextlib.contextmanager
def server_stopped(settings: StackSettings, name: str):
    """SIGSTOP one of the stack's servers (`nats` or `seaweedfs`): its sockets stay open and nothing
    answers, a real stall rather than a refusal; SIGCONT on the way out."""
    status = stack.status(settings)
    assert status is not None
    pid = next(s.pid for s in status.servers if s.name == name)
    os.kill(pid, signal.SIGSTOP)
    try:
        _until_every_thread_stopped(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _until_every_thread_stopped(pid: int) -> None:
    """A SIGSTOP reaches each thread of the server as the kernel next schedules it: on a loaded machine
    one may still answer a request sent right after kill() returned (seen with four suites on two
    cores: an append meant to time out was acknowledged). The stall begins when every thread shows `T`."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
        if states and all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"hang guard: pid {pid} not stopped ({states})"
        time.sleep(0.01)


def connection_env(settings: StackSettings, role: str = "admin", run_id: str | None = None) -> dict[str, str]:
    """`SPRAWL_...` variables that connect a worker process to the stack `settings` points at, as `role`
    of `run_id` (default: the settings' run): on a secure stack its own credentials (TLS pinned to the
    stack's CA, the role's NATS and S3 identity in that run, and in no other)."""
    own = stack.with_role(settings.model_copy(update={"run_id": run_id or settings.run_id}), role)
    nats, blobs = own.nats, own.blobs
    env = {"SPRAWL_NATS__URL": nats.url, "SPRAWL_BLOBS__ENDPOINT_URL": blobs.endpoint_url or ""}
    if nats.creds_file is not None:
        env |= {"SPRAWL_NATS__CREDS_FILE": str(nats.creds_file), "SPRAWL_NATS__INBOX_PREFIX": nats.inbox_prefix}
    if nats.tls_ca_file is not None:
        env["SPRAWL_NATS__TLS_CA_FILE"] = str(nats.tls_ca_file)
    if blobs.ca_file is not None:
        env["SPRAWL_BLOBS__CA_FILE"] = str(blobs.ca_file)
    env["SPRAWL_BLOBS__ACCESS_KEY_ID"] = blobs.access_key_id
    env["SPRAWL_BLOBS__SECRET_ACCESS_KEY"] = blobs.secret_access_key.get_secret_value()
    return env


def admin_nats(stack_directory: Path, url: str, **options: object) -> NatsSettings:
    """Connection settings for a nats-server started alone (`stack.start_nats`) in `stack_directory`: the
    stack's admin, over TLS pinned to its CA, as every client of a secure server must be."""
    from infra.stack_security import StackSecurity

    return StackSecurity(stack_directory).nats_settings(NatsSettings(**options), url, "admin", "admin")
