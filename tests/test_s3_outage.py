"""The run rides out an object-store outage: a write waits with backoff (1 s, 2 s ... at most 10 s)
for up to `blobs.outage_patience_s`, visibly, and fails loudly past it; nothing is dropped or faked.

The outage is the real SeaweedFS of the test stack, SIGSTOPped (its sockets open, nothing answers,
each attempt times out) and SIGCONTinued once the waiting status has been seen. The trainer is the
real one: its version's lineage and policy blobs wait, and its version event is appended only after
they are stored, once."""

import asyncio
import itertools
import json
import time
from collections import Counter

import msgspec
import pytest

from infra.streams import apply
from pipeline.blobstore import S3BlobStore
from pipeline.blobstore.outage import (
    FIRST_RETRY_S,
    MAX_RETRY_S,
    BlobStoreOutlasted,
    blob_store_waiting_since,
    blob_store_waits,
    ride_out_outage,
)
from pipeline.errors import BlobNotFound, BlobStoreUnavailable, WorkerPartFailed
from pipeline.eventlog import EventLog
from pipeline.materialize import verify_directory
from pipeline.replay import replay
from pipeline.subjects import policy_filter, trajectories_filter
from pipeline.topology import POLICY, TRAJECTORIES
from pipeline.version_log import chain_head, fetch_version
from schemas import PolicyVersion
from tests.chain_helpers import expected_root, materializer, signed_trust
from tests.events import trajectory
from tests.servers import HANG_GUARD_S, server_stopped
from tests.trainer_data import make_groups, publish_groups, write_initial_model
from workers.trainer.loop import Trainer
from workers.trainer.publishing import PublishFailed
from workers.trainer.settings import TrainerSection, TrainerSettings

OUTAGE_TIMEOUTS = {"max_attempts": 1, "connect_timeout_s": 1.0, "read_timeout_s": 1.0}
"""Each attempt against the stopped server gives up after a second (botocore's own retries off), so
the waiting shows within seconds; the patience, not these, decides how long an outage is waited out."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_model(tmp_path_factory.mktemp("initial"))


def _trainer(event_log, settings, model_dir, patience_s: float) -> Trainer:
    blobs = settings.blobs.model_copy(update={**OUTAGE_TIMEOUTS, "outage_patience_s": patience_s})
    trainer_settings = TrainerSettings(
        **settings.model_dump(include={"run_id", "nats", "log", "streams"}),
        blobs=blobs,
        trust=signed_trust(),
        trainer=TrainerSection(
            model_dir=model_dir, groups_per_batch=2, trainer_id="t-outage", checkpoint_every=100, max_versions=1
        ),
    )
    return Trainer(trainer_settings, event_log, S3BlobStore(blobs))


async def _until(run: asyncio.Task, predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert not run.done(), f"ended before {what}: {run}"
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


async def _versions_in_log(event_log, run_id: str) -> Counter[int]:
    events = [r.event async for r in replay(event_log, POLICY.name, policy_filter(run_id))]
    return Counter(e.version for e in events if isinstance(e, PolicyVersion))


def _log_lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]


@pytest.mark.integration
async def test_an_outage_during_a_publish_is_waited_out_visibly_and_the_version_lands_once_bit_exact(
    event_log, settings, model_dir, tmp_path, capsys
):
    run_id = settings.run_id
    trainer = _trainer(event_log, settings, model_dir, patience_s=120.0)
    run = asyncio.create_task(trainer.run(asyncio.Event()))
    await _until(run, lambda: trainer.published == [0], "v0 published")
    capsys.readouterr()
    with server_stopped(settings, "seaweedfs"):
        await publish_groups(event_log, make_groups(model_dir, run_id, 2))  # the batch of v1
        await _until(
            run, lambda: any(w.attempts >= 3 for w in blob_store_waits()), "three attempts at v1's blobs waited"
        )
        # The status while it lasts: which blob waits, since when; and nothing of v1 in the log yet.
        waiting = blob_store_waits()
        assert all(w.what.startswith(f"s3://{settings.blobs.bucket}/runs/{run_id}/") for w in waiting), waiting
        since = blob_store_waiting_since()
        assert since is not None and since <= time.time()
        assert await fetch_version(event_log, run_id, 1) is None
        assert not run.done() and trainer.published == [0]
    await asyncio.wait_for(run, HANG_GUARD_S)

    assert trainer.published == [0, 1] and blob_store_waits() == []
    assert await _versions_in_log(event_log, run_id) == {0: 1, 1: 1}  # appended once, none skipped
    event = await fetch_version(event_log, run_id, 1)
    assert event is not None and event.parent_version == 0
    # Bit-exact: the version's digests are the trainer's weights, and a follower builds exactly those.
    assert event.views[0].root_hash == expected_root(trainer.model.state_dict(), "bf16")
    got = await materializer(event_log, settings, tmp_path / "follower").materialize(1)
    assert verify_directory(got.path) == event.views[0].root_hash

    lines = _log_lines(capsys)
    waits = [line for line in lines if line.get("event") == "blob store unavailable: waiting"]
    assert len(waits) >= 3 and all(line["level"] == "warning" for line in waits)
    by_blob: dict[str, list[dict]] = {}
    for line in waits:
        by_blob.setdefault(line["what"], []).append(line)
    for blob_waits in by_blob.values():  # each attempt says for how long it has waited, and when it retries
        assert [w["attempts"] for w in blob_waits] == list(range(1, len(blob_waits) + 1))
        assert all(a["waited_s"] <= b["waited_s"] for a, b in itertools.pairwise(blob_waits))
        assert all(0 < w["retry_in_s"] <= MAX_RETRY_S and w["patience_s"] == 120.0 for w in blob_waits)
    answered = {line["what"] for line in lines if line.get("event") == "blob store answers again"}
    assert answered == set(by_blob)


@pytest.mark.integration
async def test_an_outage_longer_than_the_patience_stops_the_trainer_loudly_with_no_version_appended(
    event_log, settings, model_dir, capsys
):
    run_id = settings.run_id
    trainer = _trainer(event_log, settings, model_dir, patience_s=2.0)
    run = asyncio.create_task(trainer.run(asyncio.Event()))
    await _until(run, lambda: trainer.published == [0], "v0 published")
    with server_stopped(settings, "seaweedfs"):
        await publish_groups(event_log, make_groups(model_dir, run_id, 2))
        with pytest.raises(WorkerPartFailed) as failure:
            await asyncio.wait_for(run, HANG_GUARD_S)
    published = failure.value.__cause__
    assert isinstance(published, PublishFailed) and published.version == 1
    outlasted = published.__cause__
    assert isinstance(outlasted, BlobStoreOutlasted) and outlasted.waited_s >= 2.0
    assert "blobs.outage_patience_s=2" in str(failure.value) and "SPRAWL_BLOBS__OUTAGE_PATIENCE_S" in str(failure.value)
    assert trainer.published == [0] and blob_store_waits() == []
    assert await _versions_in_log(event_log, run_id) == {0: 1}  # v1 neither appended nor faked
    head = await chain_head(event_log, run_id)
    assert head is not None and head.version == 0
    lines = _log_lines(capsys)
    assert any(line.get("event") == "blob store unavailable for longer than the patience: giving up" for line in lines)


@pytest.mark.integration
async def test_a_claim_checked_append_waits_out_an_outage_and_its_event_names_a_stored_blob(settings):
    """A sampler's trajectory above the claim-check threshold: blob first, then the pointer event. The
    append waits while the store is down (no pointer appended meanwhile) and lands once it answers."""
    patient = settings.model_copy(
        update={"blobs": settings.blobs.model_copy(update={**OUTAGE_TIMEOUTS, "outage_patience_s": 120.0})}
    )
    event_log = await EventLog.connect(patient, worker="test-sampler")
    try:
        await apply(event_log.js, settings.streams, settings.run_id)
        big = trajectory(settings.run_id, "big-during-outage", output_tokens=20_000)
        with server_stopped(settings, "seaweedfs"):
            append = asyncio.create_task(event_log.append(big))
            await _until(append, lambda: any(w.attempts >= 2 for w in blob_store_waits()), "two attempts waited")
            (waiting,) = blob_store_waits()
            assert f"/claims/{settings.run_id}/traj/" in waiting.what and not append.done()
            counted = [r async for r in replay(event_log, TRAJECTORIES.name, trajectories_filter(settings.run_id))]
            assert counted == []  # no pointer to a blob that is not stored
        result = await asyncio.wait_for(append, HANG_GUARD_S)
        assert result.claim_checked and blob_store_waits() == []
        (stored,) = [r async for r in replay(event_log, TRAJECTORIES.name, trajectories_filter(settings.run_id))]
        assert stored.event == msgspec.structs.replace(big, producer=event_log.producer)  # resolved from the blob
    finally:
        await event_log.close()


class Store:
    """A stand-in for one write against a store that is down for the first `down` attempts."""

    def __init__(self, down: int, error: Exception | None = None):
        self.down, self.calls, self.error = down, 0, error or BlobStoreUnavailable(None, "connection refused")

    def write(self) -> str:
        self.calls += 1
        if self.calls <= self.down:
            raise self.error
        return "stored"


class Clock:
    """Time that passes only when the writer sleeps."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_backoff_doubles_from_one_second_to_ten_and_the_last_attempt_lands_at_the_patience():
    clock = Clock()
    store = Store(down=7)
    what = "s3://b/k"
    assert ride_out_outage(store.write, what=what, patience_s=60.0, sleep=clock.sleep, clock=clock) == "stored"
    assert clock.slept == [FIRST_RETRY_S, 2.0, 4.0, 8.0, MAX_RETRY_S, MAX_RETRY_S, MAX_RETRY_S]
    assert store.calls == 8 and blob_store_waits() == []

    clock, store = Clock(), Store(down=100)
    with pytest.raises(BlobStoreOutlasted) as failure:
        ride_out_outage(store.write, what=what, patience_s=20.0, sleep=clock.sleep, clock=clock)
    assert clock.slept == [1.0, 2.0, 4.0, 8.0, 5.0]  # 1+2+4+8 = 15 s, then the 5 s left of the patience
    assert (failure.value.waited_s, failure.value.attempts, store.calls) == (20.0, 6, 6)
    assert isinstance(failure.value, BlobStoreUnavailable)  # every caller's handling of an outage holds
    assert "s3://b/k" in failure.value.message and "outage_patience_s=20" in failure.value.message
    assert blob_store_waits() == []


def test_no_patience_is_one_attempt_and_only_an_outage_is_waited_out():
    clock = Clock()
    store = Store(down=1)
    with pytest.raises(BlobStoreUnavailable) as failure:
        ride_out_outage(store.write, what="k", patience_s=0.0, sleep=clock.sleep, clock=clock)
    assert not isinstance(failure.value, BlobStoreOutlasted) and (store.calls, clock.slept) == (1, [])
    refused = Store(down=1, error=BlobNotFound("s3://b/k"))  # an answer, not an outage: never retried
    with pytest.raises(BlobNotFound):
        ride_out_outage(refused.write, what="k", patience_s=60.0, sleep=clock.sleep, clock=clock)
    assert (refused.calls, clock.slept) == (1, [])


def test_a_write_that_waits_is_listed_while_it_waits():
    clock = Clock()
    seen: list[list] = []

    def sleep(seconds: float) -> None:
        seen.append(blob_store_waits())
        clock.sleep(seconds)

    store = Store(down=2)
    ride_out_outage(store.write, what="s3://b/claims/x", patience_s=60.0, sleep=sleep, clock=clock)
    assert [[(w.what, w.attempts) for w in waits] for waits in seen] == [
        [("s3://b/claims/x", 1)],
        [("s3://b/claims/x", 2)],
    ]
    assert seen[0][0].since == seen[1][0].since and "connection refused" in seen[0][0].error
    assert blob_store_waits() == [] and blob_store_waiting_since() is None
