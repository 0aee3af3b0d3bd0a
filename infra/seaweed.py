"""SeaweedFS of the local stack (`weed mini`: master, volume, filer and S3 in one process), its data
under the stack folder, its buckets created at start, healthy once every bucket answers over S3."""

from __future__ import annotations

import time
from pathlib import Path

from infra.ports import free_seaweed_base, s3_port_of, seaweed_ports
from infra.s3_identities import write_identities
from infra.server_process import PortClash, ServerRecord, check_alive, server_binary, spawn, stop_servers
from infra.stack_security import StackSecurity
from infra.stack_settings import StackSection
from pipeline.config import S3BlobSettings
from pipeline.errors import StackError


def spawn_seaweed(
    directory: Path,
    section: StackSection,
    s3: S3BlobSettings,
    base: int,
    *,
    s3_port: int = 0,
    run_id: str | None = None,
) -> ServerRecord:
    """Start SeaweedFS on the block at `base`, S3 on `s3_port` (else the configured one, else base + 8).
    Not yet healthy: `wait_seaweed` waits for that.

    Its S3 identities (`s3-identities.json` in `directory`, infra/s3_identities.py): `admin`, the
    configured credentials with every action, so the stack's own tools work as before; one identity per
    role of `run_id` (None: the roles already in the file, e.g. on a restart); token identities, added
    and revoked live through the IAM API on the S3 port, which SeaweedFS keeps in its filer."""
    data = directory / "seaweedfs"
    data.mkdir(parents=True, exist_ok=True)
    identities = write_identities(directory, s3, run_id, s3.bucket)
    s3_port = s3_port or s3_port_of(section.s3_port, base)
    argv = [
        server_binary("weed"),
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        f"-ip.bind={section.bind_host}",
        f"-s3.port={s3_port}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.autoCreateBucket=false",
        f"-s3.config={identities}",
        # The IAM API (same port, admin credentials only) adds and revokes token identities live.
        "-s3.iam.readOnly=false",
        f"-bucket={','.join(section.buckets)}",
    ] + [f"-{flag}={port}" for flag, port in seaweed_ports(base).items()]
    if section.secure:  # S3 over TLS on the same port, with a certificate from the stack's own CA
        cert = StackSecurity(directory).server_certificate("s3", section.advertise_hosts)
        argv += [f"-s3.cert.file={cert.cert_file}", f"-s3.key.file={cert.key_file}"]
    record = spawn("seaweedfs", argv, directory)
    record.endpoint = f"{'https' if section.secure else 'http'}://127.0.0.1:{s3_port}"
    record.ports = {"s3": s3_port, "base": base}
    return record


def wait_seaweed(
    directory: Path,
    section: StackSection,
    s3: S3BlobSettings,
    started: list[ServerRecord],
    deadline: float,
    *,
    attempts: int,
    s3_port: int,
) -> None:
    """Wait for `started[-1]` (SeaweedFS) to serve S3. With `attempts` > 1, a port of its block taken
    between choosing the block and binding it starts it again on another block (it replaces
    `started[-1]`), S3 on `s3_port` (0: the new block's)."""
    for attempt in range(1, attempts + 1):
        try:
            wait_s3(started[-1], section, s3, deadline)
            return
        except PortClash as clash:
            if attempt == attempts:
                raise StackError(
                    clash.message,
                    hint="choose other ports with SPRAWL_STACK__SEAWEED_PORT_BASE / SPRAWL_STACK__S3_PORT, "
                    "or 0 for free ones",
                ) from clash
        stop_servers([started.pop()])
        base = free_seaweed_base(s3_port)
        started.append(spawn_seaweed(directory, section, s3, base, s3_port=s3_port))


def wait_s3(record: ServerRecord, section: StackSection, s3: S3BlobSettings, deadline: float) -> None:
    from pipeline.blobstore import S3BlobStore
    from pipeline.errors import BlobStoreError

    last = ""
    for bucket in section.buckets:
        store = S3BlobStore(
            s3.model_copy(
                update={
                    "endpoint_url": record.endpoint,
                    "ca_file": StackSecurity(Path(record.log_file).parent).ca_file if section.secure else None,
                    "bucket": bucket,
                    "max_attempts": 1,
                    "connect_timeout_s": 1.0,
                    "read_timeout_s": 5.0,
                }
            )
        )
        while True:
            check_alive(record)
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
