"""Reading the policy-version chain from the log: its head, one version, waiting for one."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import nats.js.errors

from pipeline.errors import LogUnavailable, SprawlError
from pipeline.eventlog import NO_ANSWER, EventLog
from pipeline.subjects import policy_subject
from pipeline.topology import POLICY, policy_filter
from schemas import PolicyVersion


class VersionNotAvailable(SprawlError):
    def __init__(self, run_id: str, version: int, waited_s: float):
        self.version = version
        super().__init__(
            f"policy version {version} of run {run_id} is not in the log (waited {waited_s:.1f}s)",
            hint="the trainer has not published it yet; versions are never guessed",
        )


@dataclass(frozen=True)
class ChainHead:
    version: int
    stream_seq: int


async def chain_head(event_log: EventLog, run_id: str) -> ChainHead | None:
    """The newest version of a run's chain and its stream sequence, or None for an empty chain."""
    info = await event_log.js.stream_info(POLICY.name, subjects_filter=policy_filter(run_id))
    subjects = info.state.subjects or {}
    versions = [int(s.rsplit(".v", 1)[1]) for s in subjects if s.rsplit(".", 1)[-1][1:].isdigit()]
    if not versions:
        return None
    newest = max(versions)
    msg = await event_log.js.get_last_msg(POLICY.name, policy_subject(run_id, newest))
    return ChainHead(version=newest, stream_seq=msg.seq)


async def fetch_version(event_log: EventLog, run_id: str, version: int) -> PolicyVersion | None:
    try:
        msg = await event_log.js.get_last_msg(POLICY.name, policy_subject(run_id, version))
    except nats.js.errors.NotFoundError:
        return None
    event = await event_log.resolve(msg.data, subject=msg.subject)  # a body naming another version is poison
    if not isinstance(event, PolicyVersion) or event.version != version:
        raise SprawlError(
            f"subject {policy_subject(run_id, version)} holds {type(event).__name__}, not version {version}"
        )
    return event


async def wait_for_version(event_log: EventLog, run_id: str, version: int, timeout_s: float) -> PolicyVersion:
    """Poll the log for a version; a gap is waited out, never filled by guessing."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        unanswered: BaseException | None = None
        try:
            event = await fetch_version(event_log, run_id, version)
        except NO_ANSWER as exc:  # keep polling, but remember: silence is not "not there"
            event, unanswered = None, exc
        if event is not None:
            return event
        if time.monotonic() >= deadline:
            if unanswered is not None:
                raise LogUnavailable(f"looking up policy version {version} of run {run_id}", unanswered)
            raise VersionNotAvailable(run_id, version, timeout_s)
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 1.0)
