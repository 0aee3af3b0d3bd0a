"""The envelope every event carries, and the rules that tie `type` to `schema_version`.

Every event is a frozen msgspec Struct tagged by its `type` field
(`<kind>.v<N>`). The tag is the routing key for decoding, so an unknown type
is a decode error rather than a silently ignored blob.

The envelope is required on the wire: bytes without an `event_id`, a
`produced_at` or a `schema_version` are refused, never completed by the
decoder (two decodes of the same bytes must give the same event, and
handlers are idempotent on its id). Python producers may leave the three
out: `EventMeta` fills them in when an event is constructed, which is the
producer's side, and only there.

Constraints are `Annotated[..., msgspec.Meta(...)]` types: the same
annotation makes the decoder refuse a value and puts the rule into the
exported JSON Schema, so the schema and the decoder cannot drift apart.
"""

from __future__ import annotations

import functools
import re
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import msgspec

_TYPE_PATTERN = re.compile(r"([a-z][a-z0-9_]*)\.v([1-9][0-9]*)")
"""`<kind>.v<N>`; unnamed groups, so the JSON Schema (ECMA-262) can carry the same pattern."""


def whole_string(body: str) -> str:
    """A pattern that matches only when `body` spans the whole string, in Python and in ECMA-262 alike.

    The decoder (msgspec) and Python validators run patterns with `re.search`, where `$` also matches
    before a final newline, so `^a$` would accept "a\\n" here and refuse it in a JavaScript validator.
    The lookahead closes that gap; it is a no-op in ECMA-262, where `$` is the end of the string.
    """
    return f"^(?:{body})$(?!\\n)"


EVENT_TYPE_PATTERN = whole_string(_TYPE_PATTERN.pattern)

TOKEN_PATTERN = whole_string("[A-Za-z0-9][A-Za-z0-9_-]*")
"""An id that becomes a subject token (`pipeline.topology.token` lowercases it, then checks it)."""

Token = Annotated[
    str,
    msgspec.Meta(
        pattern=TOKEN_PATTERN,
        description="Becomes a NATS subject token: letters, digits, '_' or '-', not starting with '_' or '-'.",
    ),
]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
EventId = Annotated[
    str,
    msgspec.Meta(
        pattern=whole_string("[!-~]+"),
        description="Printable ASCII without spaces: it is part of the Nats-Msg-Id header of the event's append.",
    ),
]
UtcTime = Annotated[datetime, msgspec.Meta(tz=True)]
"""An RFC 3339 date-time with an offset (JSON Schema `format: date-time`)."""

RFC3339_SYNTAX = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})", re.ASCII)
"""The syntax of an RFC 3339 date-time. msgspec checks the ranges (month 13, hour 24, Feb 30) but also
accepts a space for the `T`, which RFC 3339's date-time (and so JSON Schema's `date-time`) does not;
the codec holds every `produced_at` to this syntax before it trusts msgspec's parse."""


def now_utc() -> datetime:
    return datetime.now(UTC)


def new_event_id() -> str:
    return uuid.uuid4().hex


@functools.lru_cache(maxsize=256)
def split_type(event_type: str) -> tuple[str, int]:
    """`policy_version.v2` -> (`policy_version`, 2); raises ValueError on anything else."""
    match = _TYPE_PATTERN.fullmatch(event_type)
    if match is None:
        raise ValueError(f"event type {event_type!r} is not of the form '<kind>.v<N>'")
    kind, version = match.groups()
    return kind, int(version)


class EventMeta(msgspec.StructMeta):
    """The metaclass of events: derives `schema_version` from the type tag, and lets producers omit the envelope.

    - A class tagged `<kind>.v<N>` gets `schema_version: Literal[N]`, so the tag is the one source of
      the version: the decoder refuses any other value and the JSON Schema says `enum: [N]`.
    - Constructing an event in Python without `event_id`, `produced_at` or `schema_version` fills them
      in (a fresh id, now, the tag's N). Decoding never passes through here: on the wire all three are
      required fields.
    """

    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any):
        tag = kwargs.get("tag")
        if isinstance(tag, str):
            _, version = split_type(tag)
            annotations = dict(namespace.get("__annotations__", {}))
            annotations["schema_version"] = Literal[version]
            namespace["__annotations__"] = annotations
        return super().__new__(mcls, name, bases, namespace, **kwargs)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "event_id" not in kwargs:
            kwargs["event_id"] = new_event_id()
        if "produced_at" not in kwargs:
            kwargs["produced_at"] = now_utc()
        if "schema_version" not in kwargs:
            tag = cls.__struct_config__.tag
            if isinstance(tag, str):
                kwargs["schema_version"] = split_type(tag)[1]
        return super().__call__(*args, **kwargs)


class Event(
    msgspec.Struct,
    metaclass=EventMeta,
    frozen=True,
    kw_only=True,
    tag_field="type",
    omit_defaults=False,
    forbid_unknown_fields=False,
):
    """Base of every event: the envelope.

    Subclasses set `tag="<kind>.v<N>"`; `schema_version` (N) is written into every payload so
    consumers in other languages can check it without parsing the tag. Unknown fields are ignored
    on purpose: evolution is additive, so an older consumer reads a newer producer's event.
    """

    run_id: Token
    """The run this event belongs to; also the second token of its subject."""
    event_id: EventId
    """Unique id of this event; handlers are idempotent on it. Required on the wire."""
    schema_version: int
    """Equals the N of the `type` tag (each tagged class narrows it to `Literal[N]`)."""
    produced_at: UtcTime
    """When the producer created the event. Required on the wire."""
    producer: str = ""
    """Who produced it: `<worker>/<host>/<pid>` or similar."""

    def __post_init__(self) -> None:
        # The decoder already holds these to the annotations; a Python producer is checked here.
        tag = type(self).__struct_config__.tag
        if not isinstance(tag, str):
            return
        _, version = split_type(tag)
        if self.schema_version != version:
            raise ValueError(
                f"schema_version {self.schema_version} does not match event type {tag!r}; "
                f"a {tag} event must carry schema_version {version}"
            )
        if not self.run_id:
            raise ValueError("run_id must not be empty")
        if not self.event_id:
            raise ValueError("event_id must not be empty")

    @classmethod
    def type_tag(cls) -> str:
        tag = cls.__struct_config__.tag
        assert isinstance(tag, str), f"{cls.__name__} has no type tag"
        return tag

    def business_key(self) -> str:
        """The key that makes two publishes 'the same event' for deduplication.

        Defaults to the event id; events with a natural key (a version number,
        a trajectory id) override it so a producer that re-creates the event
        after a crash still dedups.
        """
        return self.event_id
