"""What `stack.json` records about a running local stack: its endpoints and its servers."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infra.server_process import ServerRecord, is_nats_node
from pipeline.config import SprawlSettings


@dataclass
class StackStatus:
    state_dir: str
    nats_url: str
    nats_monitor_url: str
    s3_endpoint: str
    buckets: list[str]
    servers: list[ServerRecord]
    secure: bool = False
    """TLS and per-role identities (`infra/stack_security.py`); False in a `stack.json` written before."""
    ca_file: str = ""
    """The CA certificate clients pin, when secure."""
    already_running: bool = False
    actions: list[str] = field(default_factory=list)
    """What this `up` did, one line each ("started ...", "restarted ...", "kept ... running")."""

    def endpoints(self) -> dict[str, str]:
        return {"nats": self.nats_url, "nats_monitor": self.nats_monitor_url, "s3": self.s3_endpoint}

    def server(self, name: str) -> ServerRecord:
        return next(s for s in self.servers if s.name == name)

    def nats_servers(self) -> list[ServerRecord]:
        """The log's nodes: one server, or a cluster's (`nats`, `nats-2`, ...)."""
        return [s for s in self.servers if is_nats_node(s)]


def stack_dir(settings: SprawlSettings) -> Path:
    return settings.state_dir.resolve() / "stack"


def state_file(directory: Path) -> Path:
    return directory / "stack.json"


def read_state(directory: Path) -> StackStatus | None:
    """The stack recorded under `directory`, its servers alive or not; None when nothing is recorded."""
    path = state_file(directory)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    servers = [ServerRecord(**s) for s in data.pop("servers")]
    for transient in ("already_running", "actions"):  # about one invocation, not the stack
        data.pop(transient, None)
    return StackStatus(servers=servers, **data)


def write_state(directory: Path, status: StackStatus) -> None:
    record = asdict(status)
    for transient in ("already_running", "actions"):
        record.pop(transient)
    path = state_file(directory)
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(record, indent=2))
    staging.replace(path)  # a reader never sees half a file
