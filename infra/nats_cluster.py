"""The local stack's log as one nats-server or as a JetStream cluster of 3 (or 5) on this machine.

A cluster's nodes find one another on their route ports, which every node must know before any of them
starts: fixed ones come from `stack.nats_cluster_port`, and with 0 free ones are chosen here and, if
another program takes one before its node binds it, chosen again (as SeaweedFS's block is). Client
and monitoring ports stay the kernel's choice (-1) when 0, read back from each node's ports file.

A cluster is ready when every node is healthy *and* current with the JetStream meta leader
(`/healthz` without `js-enabled-only`): before that, creating a replicated stream fails with "no
suitable peers". Clients get every node's URL, comma-separated, and fail over between them.
"""

from __future__ import annotations

import random
import time
import urllib.error
import urllib.request
from pathlib import Path

from infra.nats_server import spawn_nats, wait_nats_ready
from infra.ports import port_is_free
from infra.server_process import PortClash, ServerRecord, check_alive, stop_servers
from infra.stack_settings import StackSection
from pipeline.errors import StackError

AUTO_ROUTE_PORTS = range(20000, 32000)
"""Where free route ports are looked for: above SeaweedFS's automatic blocks (below 20000) and below
the kernel's ephemeral ports (32768+), which outgoing connections take at any moment."""


def route_ports_for(section: StackSection) -> list[int]:
    """Every node's route port ([] for a lone server): the configured block, or free ports now."""
    nodes = section.nats_cluster
    if nodes == 1:
        return []
    if section.nats_cluster_port:
        return [section.nats_cluster_port + k for k in range(nodes)]
    for _ in range(500):
        ports = random.sample(AUTO_ROUTE_PORTS, nodes)
        if all(port_is_free(p) for p in ports):
            return ports
    raise StackError("no free ports for the log's cluster routes", hint="set SPRAWL_STACK__NATS_CLUSTER_PORT")


def start_nats_nodes(directory: Path, section: StackSection, deadline: float) -> tuple[list[ServerRecord], str, str]:
    """Start every node and wait until the log is ready; returns (records, the client URLs joined by
    commas, node 1's monitoring URL). Nothing is left running when it raises."""
    movable = section.nats_cluster > 1 and not section.nats_cluster_port
    attempts = section.seaweed_start_attempts if movable else 1
    for attempt in range(1, attempts + 1):
        route_ports = route_ports_for(section)
        records = [
            spawn_nats(directory, section, node=k, route_ports=route_ports) for k in range(1, section.nats_cluster + 1)
        ]
        try:
            urls, monitor_url = wait_nodes_ready(records, section, deadline)
            return records, urls, monitor_url
        except PortClash:
            stop_servers(records)
            if attempt == attempts:
                raise
        except BaseException:
            stop_servers(records)
            raise
    raise AssertionError("unreachable")


def wait_nodes_ready(records: list[ServerRecord], section: StackSection, deadline: float) -> tuple[str, str]:
    """Wait for every node (and, for a cluster, its meta leader); returns (client URLs, node 1's
    monitoring URL)."""
    endpoints = [wait_nats_ready(record, section, deadline) for record in records]
    if len(records) > 1:
        for record, (_, monitor_url) in zip(records, endpoints, strict=True):
            wait_current(record, monitor_url, section, deadline)
    return ",".join(url for url, _ in endpoints), endpoints[0][1]


def wait_current(record: ServerRecord, monitor_url: str, section: StackSection, deadline: float) -> None:
    """Wait until the node knows the cluster's JetStream meta leader and is current with it."""
    last = ""
    while True:
        check_alive(record)
        try:
            with urllib.request.urlopen(f"{monitor_url}/healthz", timeout=1.0) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as exc:  # 503 with the reason ("JetStream has not established contact ...")
            last = exc.read().decode(errors="replace")[:200]
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = repr(exc)
        if time.monotonic() > deadline:
            raise StackError(
                f"{record.name} did not join the log's cluster within {section.start_timeout_s:.0f}s: {last}",
                hint=f"see {record.log_file}",
            )
        time.sleep(0.1)
