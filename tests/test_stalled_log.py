"""A stalled log is never read as absence: the run lease, the last-event lookup, waiting for a version."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.errors import LogUnavailable
from pipeline.lease import LeaseHeld, RunLease
from pipeline.log_lookup import last_event_on
from pipeline.subjects import trainer_lease_subject
from pipeline.topology import TRAINER
from pipeline.version_log import VersionNotAvailable, wait_for_version
from schemas import TrainerLease
from tests.servers import server_stopped

pytestmark = pytest.mark.integration


def nats_stalled(settings):
    """SIGSTOP the session's nats-server (a real stall: the socket stays open, nothing answers)."""
    return server_stopped(settings, "nats")


async def test_a_fresh_lease_of_another_holder_refuses_the_start(event_log, settings):
    await RunLease(event_log, settings.run_id, "holder-a", ttl_s=60).take()
    with pytest.raises(LeaseHeld, match=r"already has a trainer \(holder-a\)"):
        await RunLease(event_log, settings.run_id, "holder-b", ttl_s=60).take()


async def test_the_same_holder_takes_its_lease_over_at_once(event_log, settings):
    await RunLease(event_log, settings.run_id, "holder-a", ttl_s=60).take()
    await RunLease(event_log, settings.run_id, "holder-a", ttl_s=60).take()
    last = await last_event_on(event_log, TRAINER.name, trainer_lease_subject(settings.run_id))
    assert last is not None and isinstance(last.event, TrainerLease) and last.event.holder == "holder-a"


async def test_an_empty_subject_is_none(event_log, settings):
    assert await last_event_on(event_log, TRAINER.name, trainer_lease_subject(settings.run_id)) is None


async def test_a_stalled_log_is_an_error_not_an_empty_subject(event_log, settings):
    """Before: the trainer read any failure of this lookup as "no lease" and "no checkpoint"."""
    await RunLease(event_log, settings.run_id, "holder-a", ttl_s=600).take()
    with nats_stalled(settings), pytest.raises(Exception) as failure:
        await last_event_on(event_log, TRAINER.name, trainer_lease_subject(settings.run_id))
    assert not isinstance(failure.value, AssertionError)
    # After the stall the lease is still holder-a's: nothing was taken over.
    with pytest.raises(LeaseHeld):
        await RunLease(event_log, settings.run_id, "holder-b", ttl_s=600).take()


async def test_waiting_for_a_version_through_a_stall_says_the_log_did_not_answer(event_log, settings):
    """Before: a stall until the deadline was reported as "version 3 is not in the log"."""
    with nats_stalled(settings), pytest.raises(LogUnavailable, match="policy version 3"):
        await wait_for_version(event_log, settings.run_id, 3, timeout_s=1.0)
    with pytest.raises(VersionNotAvailable):  # answered, and truly absent
        await wait_for_version(event_log, settings.run_id, 3, timeout_s=0.2)


async def test_a_patient_append_waits_out_a_stall_and_lands_once(event_log, settings):
    """The trainer's appends wait out an outage (same Nats-Msg-Id on every retry) instead of ending it."""
    from pipeline.config import LogSettings
    from pipeline.errors import AppendUnavailable
    from pipeline.eventlog import EventLog

    impatient = EventLog(
        event_log.nc, event_log.blobs, LogSettings(publish_attempts=1, publish_timeout_s=0.5), "test/patience"
    )
    lease = TrainerLease(run_id=settings.run_id, holder="patient", expires_at=0.0)
    subject = trainer_lease_subject(settings.run_id)
    with nats_stalled(settings):
        with pytest.raises(AppendUnavailable):
            await impatient.append(lease)  # one attempt: the stall wins
        waiting = asyncio.create_task(impatient.append(lease, patience_s=600))
        await asyncio.sleep(2)  # let it be refused a few times; the assertions below hold however long this is
        assert not waiting.done()
    result = await waiting
    last = await last_event_on(event_log, TRAINER.name, subject)
    assert last is not None and last.event.event_id == lease.event_id and last.stream_seq == result.seq
