"""Old event versions and how to read them as current ones.

A consumer never sees a legacy type: `decode_event` upcasts step by step
(v1 -> v2 -> ...) until it reaches a type in CURRENT_EVENTS.
"""

from __future__ import annotations

from collections.abc import Callable

from schemas.envelope import Event, Token
from schemas.events import IslandHeartbeat, IslandIdentity, VersionNumber


class IslandHeartbeatV1(Event, kw_only=True, tag="island_heartbeat.v1"):
    """v1 described the island by one free-text field, e.g. `H100-80GB/fp8_e4m3/vllm`."""

    island_id: Token
    accelerator: str
    current_version: VersionNumber | None


def _island_heartbeat_v1_to_v2(old: IslandHeartbeatV1) -> IslandHeartbeat:
    parts = old.accelerator.split("/")
    accelerator = parts[0]
    view = parts[1] if len(parts) > 1 else "unknown"
    engine = parts[2] if len(parts) > 2 else "unknown"
    return IslandHeartbeat(
        run_id=old.run_id,
        event_id=old.event_id,
        produced_at=old.produced_at,
        producer=old.producer,
        island=IslandIdentity(island_id=old.island_id, accelerator=accelerator, view=view, engine=engine),
        current_version=old.current_version,
    )


LEGACY_EVENTS: tuple[type[Event], ...] = (IslandHeartbeatV1,)

UPCASTERS: dict[type[Event], Callable[[Event], Event]] = {
    IslandHeartbeatV1: _island_heartbeat_v1_to_v2,  # type: ignore[dict-item]
}
