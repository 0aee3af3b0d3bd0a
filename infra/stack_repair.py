"""Repairing a half-dead local stack: start again only the server that died, on the ports it had and
from its data, and leave the healthy one running (same pid), so every client reconnects to the URLs
it already has. Stopping the healthy half to start both afresh would cut its clients off too, and
its ports would be the next thing to clash."""

from __future__ import annotations

import time
from pathlib import Path

from infra.nats_cluster import wait_current
from infra.nats_server import node_of, spawn_nats, wait_nats_ready
from infra.ports import free_seaweed_base, port_is_free, port_of, seaweed_ports
from infra.seaweed import spawn_seaweed, wait_seaweed
from infra.server_process import ServerRecord, binary_of, is_nats_node, is_running, stop_servers
from infra.stack_settings import StackSettings, s3_settings
from infra.stack_state import StackStatus, write_state
from pipeline.errors import StackError

_FRESH_HINT = (
    "stop the program holding it (`ss -ltnp` shows it), or start the stack afresh on other ports with "
    "`sprawl stack down` then `sprawl stack up` (its clients must then be restarted)"
)


def repair(settings: StackSettings, recorded: StackStatus, directory: Path) -> StackStatus | None:
    """Start again each recorded server that is dead; None when every one is (nothing to keep: start
    afresh). A failed repair raises and leaves the healthy server running."""
    alive = {server.name: is_running(server) for server in recorded.servers}
    if not any(alive.values()):
        return None
    servers: list[ServerRecord] = []
    actions: list[str] = []
    update: dict[str, str] = {}
    for server in recorded.servers:
        if alive[server.name]:
            servers.append(server)
            actions.append(f"kept {binary_of(server.name)} running (pid {server.pid})")
            continue
        if is_nats_node(server):
            record, (nats_url, monitor_url) = _restart_nats(settings, recorded, server, directory)
            if settings.stack.nats_cluster == 1:  # a cluster node comes back on its ports: the URLs hold
                update |= {"nats_url": nats_url, "nats_monitor_url": monitor_url}
            actions.append(
                f"restarted {_label(server.name)} (pid {server.pid} had died) as pid {record.pid} on its port "
                f"{record.ports['client']}, from its store"  # type: ignore[index]
            )
        else:
            record = _restart_seaweed(settings, recorded, server, directory)
            update["s3_endpoint"] = record.endpoint
            actions.append(
                f"restarted SeaweedFS (pid {server.pid} had died) as pid {record.pid} on its S3 port "
                f"{record.ports['s3']}, from its data"  # type: ignore[index]
            )
        servers.append(record)
    repaired = StackStatus(
        state_dir=recorded.state_dir,
        nats_url=update.get("nats_url", recorded.nats_url),
        nats_monitor_url=update.get("nats_monitor_url", recorded.nats_monitor_url),
        s3_endpoint=update.get("s3_endpoint", recorded.s3_endpoint),
        buckets=recorded.buckets,
        servers=servers,
        secure=recorded.secure,
        ca_file=recorded.ca_file,
    )
    write_state(directory, repaired)
    repaired.actions = actions
    return repaired


def _require_free(port: int, what: str) -> None:
    if not port_is_free(port):
        raise StackError(f"cannot repair the stack: port {port}, {what}, is taken by another program", hint=_FRESH_HINT)


def _restart_nats(
    settings: StackSettings, recorded: StackStatus, dead: ServerRecord, directory: Path
) -> tuple[ServerRecord, tuple[str, str]]:
    ports = dead.ports or {"client": port_of(recorded.nats_url), "monitor": port_of(recorded.nats_monitor_url)}
    _require_free(ports["client"], "nats-server's client port (its clients reconnect there)")
    _require_free(ports["monitor"], "nats-server's monitoring port")
    section = settings.stack
    route_ports = [s.ports["cluster"] for s in recorded.servers if is_nats_node(s) and s.ports and "cluster" in s.ports]
    if section.nats_cluster > 1:
        _require_free(ports["cluster"], "nats-server's route port (the other nodes dial it)")
    node = node_of(dead.name)
    record = spawn_nats(
        directory,
        section,
        node=node,
        route_ports=route_ports or None,
        client_port=ports["client"],
        monitor_port=ports["monitor"],
    )
    try:
        deadline = time.monotonic() + section.start_timeout_s
        endpoints = wait_nats_ready(record, section, deadline)
        if route_ports:  # back in the cluster, caught up with its meta leader
            wait_current(record, endpoints[1], section, deadline)
    except BaseException:  # the new one goes; the healthy half stays
        stop_servers([record])
        raise
    return record, endpoints


def _restart_seaweed(
    settings: StackSettings, recorded: StackStatus, dead: ServerRecord, directory: Path
) -> ServerRecord:
    section = settings.stack
    s3_port = (dead.ports or {}).get("s3") or port_of(recorded.s3_endpoint)
    _require_free(s3_port, "SeaweedFS's S3 port (its clients reconnect there)")
    base = (dead.ports or {}).get("base") or section.seaweed_port_base
    # Its internal ports matter to no client: a block that was chosen at start may move.
    movable = not section.seaweed_port_base
    if not base or (movable and not all(port_is_free(p) for p in seaweed_ports(base).values())):
        base = free_seaweed_base(s3_port)
    started = [spawn_seaweed(directory, section, s3_settings(settings), base, s3_port=s3_port)]
    try:
        deadline = time.monotonic() + section.start_timeout_s
        attempts = section.seaweed_start_attempts if movable else 1
        wait_seaweed(directory, section, s3_settings(settings), started, deadline, attempts=attempts, s3_port=s3_port)
    except BaseException:
        stop_servers(started)
        raise
    return started[-1]


def _label(name: str) -> str:
    """`nats-server` for a lone server, `nats-server node nats-2` for a cluster's."""
    return binary_of(name) if name == "nats" else f"{binary_of(name)} node {name}"
