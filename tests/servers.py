"""Helpers for tests that run real servers: free ports and a stack under a temp state dir."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

from infra import stack
from infra.stack import StackSection, StackSettings
from pipeline.config import LogSettings, NatsSettings, S3BlobSettings, StreamSettings


def free_port() -> int:
    for _ in range(200):
        port = random.randint(20000, 29999)
        if stack.port_is_free(port):
            return port
    raise RuntimeError("no free port found")


def free_seaweed_base() -> int:
    """A base whose 8 ports and the admin gRPC port (admin + 10000) are all free."""
    for _ in range(200):
        base = random.randint(30000, 40000)
        ports = [*range(base, base + 8), base + 7 + 10000]
        if all(stack.port_is_free(p) for p in ports):
            return base
    raise RuntimeError("no free SeaweedFS port block found")


# Short timers so redelivery happens within a test, not after 30 s.
TEST_STREAMS = StreamSettings(ack_wait_s=2.0, backoff_s=[2.0, 2.0, 2.0], max_deliver=4, duplicate_window_s=120.0)


def stack_settings(state_dir: Path, run_id: str = "test") -> StackSettings:
    section = StackSection(
        nats_port=free_port(),
        nats_monitor_port=free_port(),
        s3_port=free_port(),
        seaweed_port_base=free_seaweed_base(),
        start_timeout_s=90.0,
    )
    return StackSettings(
        run_id=run_id,
        state_dir=state_dir,
        log_format="json",
        stack=section,
        nats=NatsSettings(url=f"nats://127.0.0.1:{section.nats_port}"),
        blobs=S3BlobSettings(endpoint_url=f"http://127.0.0.1:{section.s3_port}"),
        log=LogSettings(publish_attempts=4, publish_backoff_s=0.1),
        streams=TEST_STREAMS,
    )


def new_run_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"
