"""Ports of the local stack: which are free, and SeaweedFS's block of ports derived from one base."""

from __future__ import annotations

import random
import socket
from typing import Annotated

from pydantic import Field

from pipeline.errors import StackError

Port = Annotated[int, Field(ge=0, le=65535)]
"""A TCP port; 0: any free port, chosen at start."""


def seaweed_ports(base: int) -> dict[str, int]:
    """SeaweedFS's internal ports (its flag name -> port) for a block starting at `base`."""
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


SEAWEED_SPAN = max(seaweed_ports(0).values())
"""The highest SeaweedFS port is its base + this (the admin gRPC port)."""


def s3_port_of(configured: int, base: int) -> int:
    """The S3 port: the configured one, or (0) the one after the block's internal ports."""
    return configured or base + 8


# Free SeaweedFS blocks are looked for here: base..base+8 and base+10007 all stay below 20000, clear of
# the kernel's ephemeral ports (32768+, handed to outgoing connections) and of the configured defaults.
AUTO_SEAWEED_BASES = range(2000, 9990)


def free_seaweed_base(s3_port: int) -> int:
    """A base whose block (and the S3 port, `s3_port` or base + 8) is free at this moment."""
    for _ in range(500):
        base = random.choice(AUTO_SEAWEED_BASES)
        ports = [*seaweed_ports(base).values(), s3_port or base + 8]
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


def port_of(url: str) -> int:
    """The port of a `scheme://host:port` URL recorded in `stack.json`."""
    return int(url.rstrip("/").rsplit(":", 1)[1])
