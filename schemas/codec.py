"""Encoding and decoding events: the one place bytes become typed events.

Decoding distinguishes three refusals, because consumers dead-letter each with
a different reason: bytes that are not JSON at all, a `type` nobody knows, and
a known type whose fields fail validation (including a wrong schema_version, a
missing event_id or produced_at: the decoder never invents them).
"""

from __future__ import annotations

from typing import Union

import msgspec

from schemas.envelope import RFC3339_SYNTAX, Event, split_type
from schemas.events import CURRENT_EVENTS
from schemas.upcasters import LEGACY_EVENTS, UPCASTERS

_ALL_EVENTS = CURRENT_EVENTS + LEGACY_EVENTS
_KNOWN_TYPES = {cls.type_tag(): cls for cls in _ALL_EVENTS}
_EVENT_UNION = Union[_ALL_EVENTS]  # type: ignore[valid-type]  # noqa: UP007 - a runtime tuple needs Union[]
_decoder = msgspec.json.Decoder(_EVENT_UNION)
_encoder = msgspec.json.Encoder()


class _TypeProbe(msgspec.Struct, forbid_unknown_fields=False):
    type: str = ""
    produced_at: object = None
    """Raw, for the RFC 3339 syntax check that msgspec's lenient datetime parse does not make."""


_probe_decoder = msgspec.json.Decoder(_TypeProbe)


class EventDecodeError(Exception):
    """Bytes that cannot become an event. `category` is stable: malformed, unknown_type, invalid."""

    def __init__(self, category: str, message: str, event_type: str | None = None):
        super().__init__(f"{category}: {message}")
        self.category = category
        self.event_type = event_type
        self.message = message


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(data: bytes) -> Event:
    """Decode bytes into the current version of their event type, upcasting legacy versions."""
    try:
        probe = _probe_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventDecodeError("malformed", f"not a JSON event object ({exc})") from exc
    if probe.type not in _KNOWN_TYPES:
        known = ", ".join(sorted(_KNOWN_TYPES))
        hint = ""
        try:
            kind, version = split_type(probe.type)
            newer = [t for t in _KNOWN_TYPES if t.startswith(f"{kind}.v")]
            if newer:
                hint = f"; this consumer knows {', '.join(sorted(newer))}: upgrade it to read v{version}"
        except ValueError:
            pass
        raise EventDecodeError("unknown_type", f"unknown event type {probe.type!r}{hint} (known: {known})", probe.type)
    try:
        event = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventDecodeError("invalid", f"{probe.type} failed validation: {exc}", probe.type) from exc
    if not RFC3339_SYNTAX.fullmatch(probe.produced_at):  # a str: the typed decode above accepted it as a datetime
        raise EventDecodeError(
            "invalid",
            f"{probe.type} failed validation: produced_at {probe.produced_at!r} is not an RFC 3339 date-time",
            probe.type,
        )
    return upcast(event)


def upcast(event: Event) -> Event:
    while type(event) in UPCASTERS:
        event = UPCASTERS[type(event)](event)
    return event


def known_event_types() -> list[str]:
    return sorted(_KNOWN_TYPES)
