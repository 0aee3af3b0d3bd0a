"""The envelope every event carries, and the rules that tie `type` to `schema_version`.

Every event is a frozen msgspec Struct tagged by its `type` field
(`<kind>.v<N>`). The tag is the routing key for decoding, so an unknown type
is a decode error rather than a silently ignored blob.
"""

from __future__ import annotations

import functools
import re
import uuid
from datetime import UTC, datetime

import msgspec

_TYPE_PATTERN = re.compile(r"^(?P<kind>[a-z][a-z0-9_]*)\.v(?P<version>[1-9][0-9]*)$")


def now_utc() -> datetime:
    return datetime.now(UTC)


def new_event_id() -> str:
    return uuid.uuid4().hex


@functools.lru_cache(maxsize=256)
def split_type(event_type: str) -> tuple[str, int]:
    """`policy_version.v2` -> (`policy_version`, 2); raises ValueError on anything else."""
    match = _TYPE_PATTERN.match(event_type)
    if match is None:
        raise ValueError(f"event type {event_type!r} is not of the form '<kind>.v<N>'")
    return match["kind"], int(match["version"])


class Event(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    tag_field="type",
    omit_defaults=False,
    forbid_unknown_fields=False,
):
    """Base of every event: the envelope.

    Subclasses set `tag="<kind>.v<N>"` and `SCHEMA_VERSION = N`; `schema_version`
    is written into every payload so consumers in other languages can check it
    without parsing the tag.
    """

    run_id: str
    """The run this event belongs to; also the second token of its subject."""
    event_id: str = msgspec.field(default_factory=new_event_id)
    """Unique id of this event; handlers are idempotent on it."""
    schema_version: int = 1
    """Must equal the N of the `type` tag; a mismatch is refused at decode time."""
    produced_at: datetime = msgspec.field(default_factory=now_utc)
    """When the producer created the event (UTC)."""
    producer: str = ""
    """Who produced it: `<worker>/<host>/<pid>` or similar."""

    def __post_init__(self) -> None:
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
