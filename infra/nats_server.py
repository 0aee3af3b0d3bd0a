"""nats-server of the local stack: JetStream with its store under the stack folder, started on the
configured ports or (a repair) on the ports it had, so its clients reconnect to the same URL."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from infra.ports import port_of
from infra.server_process import ServerRecord, check_alive, pid_alive, server_binary, spawn, stop_servers
from infra.stack_security import StackSecurity
from infra.stack_settings import StackSection
from pipeline.errors import StackError


def node_name(node: int) -> str:
    """A node's name in `stack.json` (and its files' stem): the first is `nats`, as a lone server's is."""
    return "nats" if node == 1 else f"nats-{node}"


def node_for_server_name(server_name: str) -> str:
    """The node's name in `stack.json` for the `server_name` it reports (in stream placements)."""
    if server_name == "sprawl_local":
        return "nats"
    return node_name(int(server_name.removeprefix("sprawl_local_")))


def node_of(name: str) -> int:
    return 1 if name == "nats" else int(name.rsplit("-", 1)[1])


def spawn_nats(
    directory: Path,
    section: StackSection,
    *,
    node: int = 1,
    route_ports: list[int] | None = None,
    client_port: int = 0,
    monitor_port: int = 0,
) -> ServerRecord:
    """Start nats-server node `node` (from 1) on `client_port`/`monitor_port` (else the configured ones,
    offset by the node; 0: any free port, reported in its ports file). `route_ports`: every node's
    route port, for a cluster (None: a lone server). Not yet healthy: `wait_nats_ready` waits for that."""
    name = node_name(node)
    store = directory / name
    store.mkdir(parents=True, exist_ok=True)
    conf = directory / f"{name}.conf"
    for stale in directory.glob("nats-server_*.ports"):  # left by a server that was SIGKILLed
        if not pid_alive(int(stale.stem.rsplit("_", 1)[1]), "nats-server"):  # another node's is live
            stale.unlink(missing_ok=True)
    client_port = client_port or _offset(section.nats_port, node)
    monitor_port = monitor_port or _offset(section.nats_monitor_port, node)
    security = StackSecurity(directory) if section.secure else None
    conf.write_text(
        "\n".join(
            [
                # A cluster's nodes need names that differ and stay the same across restarts (their
                # JetStream peers are known by them); a lone server keeps the name it always had.
                f"server_name: sprawl_local{'' if node == 1 else f'_{node}'}",
                # -1: the kernel picks a free port as the server binds, so nobody can take it in between.
                f"listen: {section.bind_host}:{client_port or -1}",
                f"http: 127.0.0.1:{monitor_port or -1}",
                # nats-server writes the ports it bound to nats-server_<pid>.ports here.
                f"ports_file_dir: {json.dumps(str(directory))}",
                f"max_payload: {section.nats_max_payload_bytes}",
                # A client's CONNECT carries its JWT, whose permissions list every subject it may use.
                "max_control_line: 65536",
                f"jetstream {{\n  store_dir: {json.dumps(str(store))}\n}}",
                *(cluster_config(node, route_ports, security) if route_ports else []),
                *(security.nats_config(section.advertise_hosts) if security is not None else []),
                "",
            ]
        )
    )
    record = spawn(name, [server_binary("nats-server"), "-c", str(conf)], directory)
    if route_ports:
        record.ports = {"cluster": route_ports[node - 1]}
    return record


def cluster_config(node: int, route_ports: list[int], security: StackSecurity | None) -> list[str]:
    """nats.conf lines joining node `node` to the others. The links between servers carry every stream's
    replication, so on a secure stack they are mutual TLS under the stack's CA: a process that is not
    one of the nodes cannot join the cluster and read the run."""
    routes = ", ".join(f"nats-route://127.0.0.1:{port}" for port in route_ports)
    lines = ["cluster {", "  name: sprawl", f"  listen: 127.0.0.1:{route_ports[node - 1]}", f"  routes: [{routes}]"]
    if security is not None:
        cert = security.route_certificate()
        lines += [
            "  tls {",
            f"    cert_file: {json.dumps(str(cert.cert_file))}",
            f"    key_file: {json.dumps(str(cert.key_file))}",
            f"    ca_file: {json.dumps(str(cert.ca_file))}",
            "    verify: true",
            "    timeout: 5",
            "  }",
        ]
    return [*lines, "}"]


def _offset(port: int, node: int) -> int:
    return port + node - 1 if port else 0


def wait_nats_ready(record: ServerRecord, section: StackSection, deadline: float) -> tuple[str, str]:
    """Wait until the server reported its ports and JetStream is healthy; returns (client URL,
    monitoring URL) and records its ports in `record`."""
    nats_url, monitor_url = nats_endpoints(record, section, deadline)
    wait_nats(record, monitor_url, section, deadline)
    record.ports = {**(record.ports or {}), "client": port_of(nats_url), "monitor": port_of(monitor_url)}
    return nats_url, monitor_url


def start_nats(directory: Path, section: StackSection) -> ServerRecord:
    """A nats-server alone, started and healthy (`record.endpoint` is its client URL); stop it with
    `stop_servers([record])`. For tests and tools that need a log server of their own to stop."""
    record = spawn_nats(directory, section)
    try:
        wait_nats_ready(record, section, time.monotonic() + section.start_timeout_s)
    except BaseException:  # a half-started server must not outlive the failed start
        stop_servers([record])
        raise
    return record


def nats_endpoints(record: ServerRecord, section: StackSection, deadline: float) -> tuple[str, str]:
    """The client URL and monitoring URL nats-server bound, from its ports file."""
    ports_file = Path(record.log_file).parent / f"nats-server_{record.pid}.ports"
    while True:
        check_alive(record)
        try:
            ports = json.loads(ports_file.read_text())
            # What clients on this machine use, whatever the server listens on (all addresses, say).
            port = port_of(ports["nats"][0])
            record.endpoint = f"{'tls' if section.secure else 'nats'}://127.0.0.1:{port}"
            return record.endpoint, ports["monitoring"][0]
        except (FileNotFoundError, ValueError, KeyError, IndexError):
            pass  # not written yet, or half written
        if time.monotonic() > deadline:
            raise StackError(
                f"nats-server did not report its ports within {section.start_timeout_s:.0f}s",
                hint=f"see {record.log_file}",
            )
        time.sleep(0.05)


def wait_nats(record: ServerRecord, monitor_url: str, section: StackSection, deadline: float) -> None:
    url = f"{monitor_url}/healthz?js-enabled-only=true"
    while True:
        check_alive(record)
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise StackError(
                f"nats-server not healthy within {section.start_timeout_s:.0f}s",
                hint=f"see {record.log_file}",
            )
        time.sleep(0.1)
