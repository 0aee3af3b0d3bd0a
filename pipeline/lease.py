"""A run's single-writer lease, kept on the log itself.

The holder appends a `TrainerLease` with an expiry and renews it with a conditional append
(expected last subject sequence = its own last lease), so two writers racing for the same run
cannot both win: the loser's append is refused by the server. A lease held by someone else and
not yet expired refuses the start; an expired one may be taken over; the same holder (a restart
with the same id) takes over at once.
"""

from __future__ import annotations

import asyncio
import time

from pipeline.errors import AppendConflict, SprawlError
from pipeline.eventlog import EventLog
from pipeline.log_lookup import last_event_on
from pipeline.subjects import trainer_lease_subject
from pipeline.topology import TRAINER
from schemas import TrainerLease


class LeaseHeld(SprawlError):
    def __init__(self, run_id: str, holder: str, seconds: float):
        self.holder = holder
        super().__init__(
            f"run {run_id} already has a trainer ({holder}), seen {seconds:.1f}s ago",
            hint="one trainer per run: stop the other one, or wait for its lease to expire",
        )


class RunLease:
    def __init__(self, event_log: EventLog, run_id: str, holder: str, ttl_s: float):
        self.log = event_log
        self.run_id = run_id
        self.holder = holder
        self.ttl_s = ttl_s
        self._seq = 0

    def _lease(self) -> TrainerLease:
        return TrainerLease(run_id=self.run_id, holder=self.holder, expires_at=time.time() + self.ttl_s)

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
        try:
            result = await self.log.append(self._lease(), expected_last_subject_seq=expected_seq)
        except AppendConflict as exc:
            raise LeaseHeld(self.run_id, "another trainer", 0.0) from exc
        self._seq = result.seq

    async def keep(self) -> None:
        """Renew every third of the TTL until cancelled; a lost lease raises LeaseHeld."""
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            await self._renew(self._seq)
