"""A run's single-writer lease, kept on the log itself.

The holder appends a `TrainerLease` with an expiry and renews it with a conditional append
(expected last subject sequence = its own last lease), so two writers racing for the same run
cannot both win: the loser's append is refused by the server. A lease held by someone else and
not yet expired refuses the start; an expired one may be taken over; the same holder (a restart
with the same id) takes over at once.

Keeping it: renewed every quarter of the TTL; a renewal the log does not answer is retried until a
quarter of the TTL before the lease's own `expires_at`, and then `LeaseLost` is raised, so its holder
stops itself while the lease is still its own, never living on past it. A holder therefore rides out
an outage of at least half the TTL.
"""

from __future__ import annotations

import asyncio
import time

from pipeline.errors import AppendConflict, SprawlError, StreamNotDeclared, TransientError
from pipeline.eventlog import EventLog
from pipeline.log_lookup import last_event_on
from pipeline.logs import get_logger
from pipeline.subjects import trainer_lease_subject
from pipeline.topology import TRAINER
from schemas import TrainerLease

log = get_logger(__name__)


class LeaseHeld(SprawlError):
    def __init__(self, run_id: str, holder: str, seconds: float):
        self.holder = holder
        super().__init__(
            f"run {run_id} already has a trainer ({holder}), seen {seconds:.1f}s ago",
            hint="one trainer per run: stop the other one, or wait for its lease to expire",
        )


class LeaseLost(SprawlError):
    def __init__(self, run_id: str, holder: str, expires_in_s: float, cause: BaseException | None):
        self.expires_in_s = expires_in_s
        why = cause.message if isinstance(cause, SprawlError) else repr(cause)
        super().__init__(
            f"the lease of run {run_id} ({holder}) could not be renewed and expires in {expires_in_s:.1f}s "
            f"(last error: {why}); stopping before another trainer may take over",
            hint="is nats-server reachable? a restarted trainer with the same id takes the lease back at once",
        )


class RunLease:
    def __init__(self, event_log: EventLog, run_id: str, holder: str, ttl_s: float):
        self.log = event_log
        self.run_id = run_id
        self.holder = holder
        self.ttl_s = ttl_s
        self.expires_at = 0.0
        """Unix time at which the last lease this holder appended (and the server confirmed) expires."""
        self._seq = 0

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 4

    @property
    def margin_s(self) -> float:
        """How long before `expires_at` a holder that cannot renew gives up (LeaseLost)."""
        return self.ttl_s / 4

    async def take(self) -> None:
        """Take the lease, or raise LeaseHeld if another holder's lease is still fresh."""
        last = await last_event_on(self.log, TRAINER.name, trainer_lease_subject(self.run_id))
        seq = 0
        if last is not None:
            seq = last.stream_seq
            lease = last.event
            now = time.time()
            if isinstance(lease, TrainerLease) and lease.holder != self.holder and lease.expires_at > now:
                raise LeaseHeld(self.run_id, lease.holder, now - (lease.expires_at - self.ttl_s))
        await self._renew(seq)

    async def _renew(self, expected_seq: int) -> None:
        lease = TrainerLease(run_id=self.run_id, holder=self.holder, expires_at=time.time() + self.ttl_s)
        try:
            result = await self.log.append(lease, expected_last_subject_seq=expected_seq)
        except AppendConflict as exc:
            raise LeaseHeld(self.run_id, "another trainer", 0.0) from exc
        self._seq = result.seq
        self.expires_at = lease.expires_at

    async def keep(self) -> None:
        """Renew every quarter of the TTL until cancelled. A rival's lease raises LeaseHeld; a log that
        does not answer until the margin before expiry raises LeaseLost."""
        while True:
            renewed_at = self.expires_at - self.ttl_s
            await asyncio.sleep(max(0.0, renewed_at + self.renew_every_s - time.time()))
            await self.renew_before_expiry()

    async def renew_before_expiry(self) -> None:
        """Renew, retrying what the log did not answer, until `margin_s` before `expires_at`."""
        delay, last_error = 0.2, None
        attempt: asyncio.Task | None = None
        try:
            while (left := self.expires_at - self.margin_s - time.time()) > 0:
                # Each attempt is bounded by the deadline, whatever the append's own retries would take.
                attempt = asyncio.ensure_future(self._renew_adopting_our_own())
                done, _ = await asyncio.wait({attempt}, timeout=left)
                if attempt in done:
                    try:
                        attempt.result()
                        return
                    except (TransientError, StreamNotDeclared) as exc:  # no responders while it restarts
                        last_error = exc
                else:
                    last_error = TimeoutError(f"no answer within {left:.1f}s")
                    _abandon(attempt)
                attempt = None
                log.warning(
                    "lease renewal failed, retrying",
                    expires_in_s=round(self.expires_at - time.time(), 1),
                    gives_up_in_s=round(self.expires_at - self.margin_s - time.time(), 1),
                    error=repr(last_error),
                )
                await asyncio.sleep(min(delay, max(self.expires_at - self.margin_s - time.time(), 0)))
                delay = min(delay * 2, 2.0)
        finally:
            if attempt is not None and not attempt.done():
                _abandon(attempt)
        raise LeaseLost(self.run_id, self.holder, self.expires_at - time.time(), last_error)

    async def _renew_adopting_our_own(self) -> None:
        """Renew; when the head of the lease subject moved on because an earlier renewal of ours landed
        after we stopped waiting for it, renew on top of that one."""
        try:
            await self._renew(self._seq)
        except LeaseHeld:
            last = await last_event_on(self.log, TRAINER.name, trainer_lease_subject(self.run_id))
            if last is None or not isinstance(last.event, TrainerLease) or last.event.holder != self.holder:
                raise
            self._seq = last.stream_seq
            self.expires_at = max(self.expires_at, last.event.expires_at)
            await self._renew(self._seq)


def _abandon(attempt: asyncio.Future) -> None:
    """Cancel a renewal attempt without awaiting it (nats-py may turn the cancellation into a retried
    timeout), and collect whatever it ends with, so it is not reported as "never retrieved"."""
    attempt.cancel()
    attempt.add_done_callback(lambda t: t.cancelled() or t.exception())
