"""A throwaway stack for benchmarks: nats-server + SeaweedFS in a temp dir, never the user's.

Ports are 0: each server binds a free port as it starts and the stack reports it, so two
benchmarks (or a benchmark beside a test suite) never race for a port chosen in advance.
Secure (TLS, per-role identities) unless `secure=False`; `bind_host`/`advertise_hosts` for a stack
that islands on other networks reach (`--wan`: the lab's hub, on each island link's hub address).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from infra import stack
from infra.stack import StackSection, StackSettings


@contextlib.contextmanager
def private_stack(
    run_id: str, *, secure: bool = True, bind_host: str = "127.0.0.1", advertise_hosts: Sequence[str] = ()
) -> Iterator[StackSettings]:
    with tempfile.TemporaryDirectory(prefix="sprawl-bench-") as tmp:
        section = StackSection(
            nats_port=0,
            nats_monitor_port=0,
            s3_port=0,
            seaweed_port_base=0,
            secure=secure,
            bind_host=bind_host,
            advertise_hosts=list(advertise_hosts),
        )
        settings = StackSettings(run_id=run_id, state_dir=Path(tmp), stack=section)
        settings = stack.with_endpoints(settings, stack.up(settings))
        try:
            yield settings
        finally:
            stack.down(settings)
