"""A throwaway stack for benchmarks: nats-server + SeaweedFS in a temp dir, never the user's.

Ports are 0: each server binds a free port as it starts and the stack reports it, so two
benchmarks (or a benchmark beside a test suite) never race for a port chosen in advance.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from infra import stack
from infra.stack import StackSection, StackSettings


@contextlib.contextmanager
def private_stack(run_id: str) -> Iterator[StackSettings]:
    with tempfile.TemporaryDirectory(prefix="sprawl-bench-") as tmp:
        section = StackSection(nats_port=0, nats_monitor_port=0, s3_port=0, seaweed_port_base=0)
        settings = StackSettings(run_id=run_id, state_dir=Path(tmp), stack=section)
        settings = stack.with_endpoints(settings, stack.up(settings))
        try:
            yield settings
        finally:
            stack.down(settings)
