"""Questions answered by the log itself, telling "there is none" apart from "the log did not answer".

Reading a timeout as absence is how a trainer takes a lease another trainer holds, starts from
scratch past a checkpoint it could not see, or drops a group as incomplete while the log holds all
of it; so only the server's own answer counts, and every failure to get one propagates.
"""

from __future__ import annotations

from dataclasses import dataclass

import nats.js.errors

from pipeline.errors import LogUnavailable
from pipeline.eventlog import NO_ANSWER, EventLog
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


async def count_subjects(event_log: EventLog, stream: str, subject_filter: str) -> int:
    """How many subjects of `stream` matching `subject_filter` hold at least one message, on the server's
    word (stream info with a subjects filter). With one subject per logical id (a trajectory on
    `rl.<run>.traj.<group>.<trajectory_id>`), counting `rl.<run>.traj.<group>.*` is how many of a group's
    trajectories the log holds.

    Raises LogUnavailable when the server does not answer: a count we could not get is never zero.
    The server lists up to 100,000 subjects per answer; a filter matching more is refused rather
    than undercounted.
    """
    try:
        info = await event_log.js.stream_info(stream, subjects_filter=subject_filter)
    except NO_ANSWER as exc:
        raise LogUnavailable(f"counting the subjects of {stream} matching {subject_filter}", exc) from exc
    subjects = info.state.subjects or {}
    if len(subjects) >= _SERVER_SUBJECT_PAGE:
        raise ValueError(
            f"{subject_filter} matches {len(subjects)} or more subjects in {stream}, more than one answer "
            "of the server lists; count a narrower filter"
        )
    return sum(1 for count in subjects.values() if count > 0)


_SERVER_SUBJECT_PAGE = 100_000
"""nats-server's JSMaxSubjectDetails: the most subjects one stream-info answer lists."""
