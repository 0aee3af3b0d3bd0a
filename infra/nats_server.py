"""nats-server of the local stack: JetStream with its store under the stack folder, started on the
configured ports or (a repair) on the ports it had, so its clients reconnect to the same URL."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from infra.ports import port_of
from infra.server_process import ServerRecord, check_alive, server_binary, spawn, stop_servers
from infra.stack_security import StackSecurity
from infra.stack_settings import StackSection
from pipeline.errors import StackError


def spawn_nats(directory: Path, section: StackSection, *, client_port: int = 0, monitor_port: int = 0) -> ServerRecord:
    """Start nats-server on `client_port`/`monitor_port` (else the configured ones; 0: any free port,
    reported in its ports file). Not yet healthy: `wait_nats_ready` waits for that."""
    store = directory / "nats"
    store.mkdir(parents=True, exist_ok=True)
    conf = directory / "nats.conf"
    for stale in directory.glob("nats-server_*.ports"):  # left by a server that was SIGKILLed
        stale.unlink(missing_ok=True)
    client_port = client_port or section.nats_port
    monitor_port = monitor_port or section.nats_monitor_port
    security = StackSecurity(directory).nats_config(section.advertise_hosts) if section.secure else []
    conf.write_text(
        "\n".join(
            [
                "server_name: sprawl_local",
                # -1: the kernel picks a free port as the server binds, so nobody can take it in between.
                f"listen: {section.bind_host}:{client_port or -1}",
                f"http: 127.0.0.1:{monitor_port or -1}",
                # nats-server writes the ports it bound to nats-server_<pid>.ports here.
                f"ports_file_dir: {json.dumps(str(directory))}",
                f"max_payload: {section.nats_max_payload_bytes}",
                # A client's CONNECT carries its JWT, whose permissions list every subject it may use.
                "max_control_line: 65536",
                f"jetstream {{\n  store_dir: {json.dumps(str(store))}\n}}",
                *security,
                "",
            ]
        )
    )
    return spawn("nats", [server_binary("nats-server"), "-c", str(conf)], directory)


def wait_nats_ready(record: ServerRecord, section: StackSection, deadline: float) -> tuple[str, str]:
    """Wait until the server reported its ports and JetStream is healthy; returns (client URL,
    monitoring URL) and records its ports in `record`."""
    nats_url, monitor_url = nats_endpoints(record, section, deadline)
    wait_nats(record, monitor_url, section, deadline)
    record.ports = {"client": port_of(nats_url), "monitor": port_of(monitor_url)}
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
