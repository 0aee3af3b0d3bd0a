"""A throwaway stack for benchmarks: nats-server + SeaweedFS on free ports in a temp dir, never the user's."""

from __future__ import annotations

import contextlib
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from infra import stack
from infra.stack import StackSection, StackSettings
from pipeline.config import NatsSettings, S3BlobSettings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_seaweed_base() -> int:
    for base in range(31000, 39000, 37):
        if all(stack.port_is_free(p) for p in [*range(base, base + 8), base + 7 + 10000]):
            return base
    raise RuntimeError("no free port block for SeaweedFS")


@contextlib.contextmanager
def private_stack(run_id: str) -> Iterator[StackSettings]:
    with tempfile.TemporaryDirectory(prefix="sprawl-bench-") as tmp:
        section = StackSection(
            nats_port=free_port(),
            nats_monitor_port=free_port(),
            s3_port=free_port(),
            seaweed_port_base=free_seaweed_base(),
        )
        settings = StackSettings(
            run_id=run_id,
            state_dir=Path(tmp),
            stack=section,
            nats=NatsSettings(url=f"nats://127.0.0.1:{section.nats_port}"),
            blobs=S3BlobSettings(endpoint_url=f"http://127.0.0.1:{section.s3_port}"),
        )
        stack.up(settings)
        try:
            yield settings
        finally:
            stack.down(settings)
