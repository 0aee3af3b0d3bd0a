"""The local stack's settings: its ports, buckets and start-up limits."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from infra.ports import SEAWEED_SPAN, Port, seaweed_ports
from pipeline.config import MIB, S3BlobSettings, Section, SprawlSettings

BucketName = Annotated[(str, *S3BlobSettings.model_fields["bucket"].metadata)]
"""An S3 bucket name, checked as `blobs.bucket` is."""


class StackSection(Section):
    nats_port: Port = 4222
    """NATS client port (127.0.0.1 only); 0: any free port."""
    nats_monitor_port: Port = Field(8222, validate_default=True)
    """NATS HTTP monitoring port (health checks); 0: any free port."""
    nats_cluster: Literal[1, 3, 5] = 1
    """JetStream servers on this machine. 3 make a cluster whose streams (3 replicas, `streams.replicas`)
    survive losing any one; with 5 the cluster's metadata survives losing two, each stream still one
    unless `streams.replicas` is 5. Node k (from 1) listens on nats_port + k - 1, nats_monitor_port + k - 1
    and nats_cluster_port + k - 1 (ports that are 0 stay 0: chosen at start)."""
    nats_cluster_port: Port = Field(6222, validate_default=True)
    """First node's route port (the servers' links to one another; with 3 nodes also the next two);
    0: free ports chosen at start. Unused with one node."""
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
    secure: bool = True
    """TLS on the log (a CA made for this stack) and per-role identities on the log and the blob store.
    Off only for throwaway experiments on one machine: then anyone who reaches a port owns the run."""
    bind_host: str = "127.0.0.1"
    """Address the log's client port listens on. 127.0.0.1 keeps it on this machine; islands elsewhere
    need an address they can reach (listed in `advertise_hosts` for the certificate)."""
    advertise_hosts: list[str] = []
    """Names and addresses islands use to reach the stack, besides 127.0.0.1 and localhost: the
    server certificates list them, so TLS verification succeeds from there."""
    nats_max_payload_bytes: int = Field(8 * MIB, ge=256 * 1024, le=64 * MIB)
    """Largest message nats-server accepts: at least the default claim-check threshold (256 KiB;
    larger events are claim-checked) and at most 64 MiB (nats-server's own limit)."""

    @field_validator("nats_monitor_port", "nats_cluster_port", "s3_port", "seaweed_port_base")
    @classmethod
    def _ports_differ(cls, value: int, info: ValidationInfo) -> int:
        """A fixed port used twice would fail at start ("address in use"): name the fields that clash."""
        if not value:
            return value
        names = ("nats_port", "nats_monitor_port", "nats_cluster_port", "s3_port")
        fixed = {name: info.data.get(name) for name in names}
        fixed = {name: port for name, port in fixed.items() if port and name != info.field_name}
        if info.field_name == "seaweed_port_base":
            taken = set(seaweed_ports(value).values()) | ({value + 8} if not info.data.get("s3_port") else set())
            clashes = [f"{name} ({port})" for name, port in fixed.items() if port in taken]
            if clashes:
                raise ValueError(f"SeaweedFS's ports from this base take {' and '.join(clashes)}: move one of them")
            return value
        clashes = [name for name, port in fixed.items() if port == value]
        if clashes:
            raise ValueError(f"the same port as {' and '.join(clashes)}: the stack's fixed ports must differ")
        return value

    @model_validator(mode="after")
    def _node_blocks_differ(self) -> StackSection:
        """A cluster's nodes take a block of each port (node k: base + k): no two may meet."""
        seen: dict[int, str] = {}
        for name, port in _node_ports(self).items():
            if port in seen:
                raise ValueError(
                    f"{name} is port {port}, also {seen[port]}: with nats_cluster = {self.nats_cluster} each of "
                    "nats_port, nats_monitor_port and nats_cluster_port takes that many ports from its base"
                )
            seen[port] = name
        return self


def _node_ports(section: StackSection) -> dict[str, int]:
    """Every fixed port the log's nodes take, by what takes it."""
    ports = {}
    for k in range(section.nats_cluster):
        for field in ("nats_port", "nats_monitor_port", "nats_cluster_port"):
            base = getattr(section, field)
            if base and (field != "nats_cluster_port" or section.nats_cluster > 1):
                ports[f"{field} + {k}" if k else field] = base + k
    return ports


class StackSettings(SprawlSettings):
    stack: StackSection = StackSection()
    """Ports and limits of the local stack."""


def s3_settings(settings: SprawlSettings) -> S3BlobSettings:
    """The S3 credentials SeaweedFS is started with (the defaults when the run's blobs are a folder)."""
    return settings.blobs if isinstance(settings.blobs, S3BlobSettings) else S3BlobSettings()
