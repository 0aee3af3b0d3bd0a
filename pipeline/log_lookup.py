"""The newest event on one subject, telling "there is none" apart from "the log did not answer".

Reading a timeout as absence is how a trainer takes a lease another trainer holds, or starts
from scratch past a checkpoint it could not see; so only the server's own "no message" answer
means None, and every other failure propagates.
"""

from __future__ import annotations

from dataclasses import dataclass

import nats.js.errors

from pipeline.eventlog import EventLog
from schemas import Event


@dataclass(frozen=True)
class LastEvent:
    event: Event
    stream_seq: int


async def last_event_on(event_log: EventLog, stream: str, subject: str) -> LastEvent | None:
    """The last event stored on `subject`, or None when the stream holds no message there."""
    try:
        msg = await event_log.js.get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:
        return None
    return LastEvent(await event_log.resolve(msg.data), msg.seq)
