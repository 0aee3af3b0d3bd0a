"""The archiver under fire: poison archived and dead-lettered on every stream, an object-store outage
waited out without acking anything unwritten, fatal errors ending the process, and SIGKILLs at
several points that lose no row and write none twice."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from infra.streams import apply
from pipeline.blobstore import open_blob_store
from pipeline.errors import BlobStoreUnavailable, PoisonEvent
from pipeline.eventlog import CLAIM_CHECK_HEADER, EventLog
from pipeline.sql import open_duckdb
from pipeline.subjects import (
    dead_letter_subject,
    prompts_subject,
    reward_subject,
    subject_for,
    trainer_lease_subject,
    trajectory_subject,
)
from pipeline.topology import METRICS, REWARDS, STREAMS, TRAJECTORIES, ConsumerRole, consumer_for
from schemas import ClaimCheck, IslandHeartbeat, IslandIdentity, Reward
from schemas.archive import ROW_COLUMNS, UNDECODABLE, ArchiveKey, parquet_glob, run_prefix
from schemas.codec import encode_event
from schemas.events import CURRENT_EVENTS
from tests.events import trajectory as big_trajectory
from tests.servers import HANG_GUARD_S, connection_env, new_run_id, server_stopped
from workers.archiver import Archiver, ArchiverSettings, ArchiveSection, drain_once
from workers.archiver.process import open_archive_store
from workers.archiver.progress import ArchivedSeqs
from workers.archiver.rows import archive_files
from workers.archiver.stream import StreamArchiver
from workers.archiver.waits import Abandoned, Waits, WaitState

pytestmark = pytest.mark.integration

ISLAND = IslandIdentity(island_id="isl", accelerator="cpu", view="bf16", engine="torch")


# ---------------------------------------------------------------- helpers


def _settings(settings, *, blobs: dict | None = None, **archive) -> ArchiverSettings:
    return ArchiverSettings(
        **settings.model_dump(include={"run_id", "nats", "blobs", "log"}),
        archive=ArchiveSection(**archive),
    ).model_copy(update={"blobs": settings.blobs.model_copy(update=blobs or {})})


def _reward(run_id: str, i: int, group: str = "g0") -> Reward:
    return Reward(
        run_id=run_id,
        trajectory_id=f"t{i}",
        group_id=group,
        value=float(i),
        verifier="exact",
        verifier_version="1",
        duration_s=0.1,
    )


def _heartbeat(run_id: str, i: int) -> IslandHeartbeat:
    return IslandHeartbeat(run_id=run_id, island=ISLAND, current_version=i)


async def _publish_mixed(event_log: EventLog, run_id: str, n: int, start: int = 0, junk: bool = True) -> None:
    """Rewards, heartbeats, and (with `junk`) every fifth message junk on the metrics subject, so files
    of one type from the metrics stream are not dense."""
    for i in range(start, start + n):
        await event_log.append(_reward(run_id, i))
        await event_log.append(_heartbeat(run_id, i))
        if junk and i % 5 == 0:
            await event_log.js.publish(subject_for(_heartbeat(run_id, i)), b"junk %d" % i)


async def _log_counts(event_log: EventLog, run_id: str) -> dict[str, int]:
    counts = {}
    for stream in STREAMS:
        info = await event_log.js.stream_info(stream.name, subjects_filter=stream.run_filter(run_id))
        counts[stream.label] = sum((info.state.subjects or {}).values())
    return counts


def _archived_rows(settings, run_id: str) -> list[tuple[str, int]]:
    """(stream, seq) of every archived row of the run, duplicates included."""
    if not ArchiveKey.parse_listing(open_blob_store(settings.blobs).list_keys(run_prefix(run_id))):
        return []
    con = open_duckdb(settings)
    files = f"s3://{settings.blobs.bucket}/{parquet_glob(run_id)}"
    return con.sql(f"SELECT log_stream, log_seq FROM read_parquet('{files}', union_by_name = true)").fetchall()


def _assert_archive_is_the_log(settings, run_id: str, counts: dict[str, int]) -> None:
    rows = _archived_rows(settings, run_id)
    assert len(rows) == len(set(rows)), "a (stream, seq) archived twice"
    per_stream = {label: 0 for label in counts}
    for label, _ in rows:
        per_stream[label] += 1
    assert per_stream == counts


async def _pending(event_log: EventLog, run_id: str) -> int:
    """Messages the archiver consumers have not had acked yet (undelivered or unacked)."""
    total = 0
    for stream in STREAMS:
        consumer = consumer_for(run_id, ConsumerRole.ARCHIVER, stream)
        info = await event_log.js.consumer_info(stream.name, consumer.name)
        total += info.num_pending + info.num_ack_pending
    return total


async def _until(condition, what: str) -> None:
    """Await `condition()` (sync or async) becoming true; the guard only turns a hang into a failure."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.1)


def _env(settings, run_id: str, **archive) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")}
    env |= {
        "SPRAWL_RUN_ID": run_id,
        **connection_env(settings, "archiver", run_id),
        "SPRAWL_LOG_LEVEL": "INFO",
    }
    env |= {f"SPRAWL_ARCHIVE__{k.upper()}": str(v) for k, v in archive.items()}
    return env


def _start_archiver(env: dict[str, str], log_path) -> subprocess.Popen:
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "archiver"], env=env, stdout=log_file, stderr=log_file
        )


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=HANG_GUARD_S)


# ---------------------------------------------------------------- progress, pure


@given(st.lists(st.tuples(st.integers(1, 200), st.integers(0, 12)), max_size=40))
def test_archived_seqs_hold_exactly_what_was_added(ranges):
    seqs, expected = ArchivedSeqs(), set()
    for first, length in ranges:
        if length % 3 == 0:
            seqs.add_all(range(first, first + length, 2))  # every other: not one range
            expected |= set(range(first, first + length, 2))
        else:
            seqs.add_range(first, first + length)
            expected |= set(range(first, first + length + 1))
    assert {s for s in range(0, 230) if s in seqs} == expected
    assert len(seqs) == len(expected)
    bounds = seqs.ranges
    assert all(a[1] + 1 < b[0] for a, b in itertools.pairwise(bounds))  # disjoint, merged


def test_no_event_field_is_named_like_an_envelope_column():
    for event in CURRENT_EVENTS:
        fields = {f.encode_name for f in msgspec.inspect.type_info(event).fields}
        assert not fields & set(ROW_COLUMNS), event


async def test_a_transient_state_is_retried_until_done_given_up_at_its_limit_and_abandoned_on_stop():
    s3 = WaitState.S3_UNAVAILABLE
    calls = 0

    async def answers_third_time() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise BlobStoreUnavailable(None, "connection refused")
        return "written"

    async def never_answers() -> None:
        raise BlobStoreUnavailable(None, "connection refused")

    waits = Waits(ArchiveSection(retry_first_s=0.01, retry_max_s=0.02, give_up_after_s=0.3))
    retry = {"stream": "rewards", "state": s3, "transient": (BlobStoreUnavailable,), "stop": asyncio.Event()}
    assert await waits.until_done(answers_third_time, **retry) == "written"
    assert (calls, waits.retries[s3], waits.waiting) == (3, 2, {})
    with pytest.raises(BlobStoreUnavailable):  # past give_up_after_s: the error, for the process to exit on
        await waits.until_done(never_answers, **retry)
    assert waits.retries[s3] > 3 and waits.waiting == {}
    stopping = asyncio.Event()
    stopping.set()
    with pytest.raises(Abandoned):  # stopping while waiting: given up, nothing acked
        await Waits(ArchiveSection()).until_done(never_answers, **(retry | {"stop": stopping}))
    with pytest.raises(PoisonEvent):  # anything not transient is not retried
        await waits.until_done(functools.partial(_raise, PoisonEvent("bad")), **retry)


async def _raise(error: Exception) -> None:
    raise error


# ---------------------------------------------------------------- poison


async def test_poison_on_every_stream_is_archived_and_dead_lettered_and_archiving_goes_on(event_log, settings):
    """Before: only PoisonEvent was caught, so a claim check naming a missing bucket killed its stream's
    task and the archiver lived on archiving nothing; garbage on REWARDS, METRICS, TRAINER (and PROMPTS
    with no sampler) was never dead-lettered, since only the consumers that handle events did it."""
    run = settings.run_id
    junk = b"\x1b[2J\x00 not an event"
    poison = {
        "rewards": reward_subject(run, "g0", "junk"),
        "metrics": subject_for(_heartbeat(run, 0)),
        "trainer": trainer_lease_subject(run),
        "prompts": prompts_subject(run),
        "trajectories": trajectory_subject(run, "g0", "junk"),
    }
    for subject in poison.values():
        await event_log.js.publish(subject, junk)
    # Claim checks pointing at a bucket that does not exist, and at a blob that does not exist.
    bucket = settings.blobs.bucket
    for trajectory, uri in [("t1", "s3://no-such-bucket-here/claims/x"), ("t2", f"s3://{bucket}/claims/{run}/gone")]:
        claim = ClaimCheck(run_id=run, event_type="reward.v1", uri=uri, sha256="0" * 64, bytes=10)
        headers = {CLAIM_CHECK_HEADER: "1"}
        await event_log.js.publish(reward_subject(run, "g1", trajectory), encode_event(claim), headers=headers)
    elsewhere = _reward(run, 7, group="g-other")  # its body says group g-other, its subject g1
    await event_log.js.publish(reward_subject(run, "g1", "t7"), encode_event(elsewhere))
    await event_log.js.publish(dead_letter_subject(run, "rewards", 999), junk)  # on the dead-letter stream itself
    await _publish_mixed(event_log, run, 3, junk=False)  # and good events after all of it, on two streams

    await drain_once(_settings(settings))

    con = open_duckdb(settings)
    dead = con.sql(
        f"SELECT stream, original_subject, consumer, error_class, payload "
        f"FROM read_parquet('s3://{bucket}/{parquet_glob(run, 'dead_letter.v1')}') ORDER BY stream, original_subject"
    ).fetchall()
    expected = sorted(
        [(label, subject, f"{run}-archiver-{label}", "malformed", junk) for label, subject in poison.items()]
        + [
            # Refused before any GET: only the run's own claims prefix is fetched (EventLog.resolve).
            ("rewards", reward_subject(run, "g1", "t1"), f"{run}-archiver-rewards", "claim_check_foreign"),
            ("rewards", reward_subject(run, "g1", "t2"), f"{run}-archiver-rewards", "claim_check_missing"),
            ("rewards", reward_subject(run, "g1", "t7"), f"{run}-archiver-rewards", "subject_mismatch"),
        ],
        key=lambda row: (row[0], row[1]),
    )
    assert [row[:4] for row in dead] == [row[:4] for row in expected]
    assert [row[4] for row in dead if row[3] == "malformed"] == [junk] * len(poison)  # the refused bytes

    undecodable = con.sql(
        f"SELECT log_stream, error_class FROM read_parquet('s3://{bucket}/{parquet_glob(run, 'undecodable')}')"
    ).fetchall()
    assert sorted(undecodable) == sorted([(row[0], row[3]) for row in expected] + [("deadletter", "malformed")])
    # Archiving went on past the poison, on every stream: the good events are all there.
    rewards = con.sql(f"SELECT count(*) FROM read_parquet('s3://{bucket}/{parquet_glob(run, 'reward.v1')}')")
    assert rewards.fetchone()[0] == 3
    _assert_archive_is_the_log(settings, run, await _log_counts(event_log, run))


# ---------------------------------------------------------------- transient: an object-store outage


async def test_an_s3_outage_during_a_flush_acks_nothing_unwritten_and_resumes(event_log, settings, capsys):
    run = settings.run_id
    archiver_settings = _settings(
        settings,
        blobs={"connect_timeout_s": 1.0, "read_timeout_s": 1.0, "max_attempts": 1},
        flush_interval_s=0.2,
        retry_first_s=0.1,
        retry_max_s=0.5,
    )
    archiver = Archiver(archiver_settings, event_log, open_archive_store(archiver_settings))
    stop = asyncio.Event()
    task = asyncio.create_task(archiver.run(stop))
    try:
        first = await event_log.append(_reward(run, 0))
        await _until(lambda: archiver.archived == 1, "the first reward archived")
        consumer = consumer_for(run, ConsumerRole.ARCHIVER, REWARDS)
        with server_stopped(settings, "seaweedfs"):
            for i in range(1, 21):
                await event_log.append(_reward(run, i))
            await _until(lambda: archiver.waits.retries[WaitState.S3_UNAVAILABLE] >= 3, "three retries of the PUT")
            assert ("rewards", WaitState.S3_UNAVAILABLE) in archiver.waits.waiting
            info = await event_log.js.consumer_info(REWARDS.name, consumer.name)
            assert info.ack_floor.stream_seq == first.seq  # nothing acked past the reward written before
            assert info.num_ack_pending + info.num_pending == 20
            assert not task.done()
        await _until(lambda: archiver.archived == 21, "the rewards archived after the outage")
        assert archiver.waits.waiting == {}
    finally:
        stop.set()
        await task
    info = await event_log.js.consumer_info(REWARDS.name, consumer.name)
    assert info.num_ack_pending + info.num_pending == 0
    _assert_archive_is_the_log(settings, run, await _log_counts(event_log, run))
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    waiting = [line for line in lines if line.get("event") == "waiting" and line.get("state") == "s3_unavailable"]
    assert len(waiting) >= 3  # repeated while it lasted, each saying for how long
    assert all(line["stream"] == "rewards" and "lasted_s" in line for line in waiting)
    assert waiting[-1]["lasted_s"] > waiting[0]["lasted_s"]
    assert any(line.get("event") == "recovered" and line.get("state") == "s3_unavailable" for line in lines)


# ---------------------------------------------------------------- fatal: the process exits


@pytest.mark.parametrize("fault", ["consumer_deleted", "credentials_refused"])
async def test_a_fatal_error_ends_the_archiver_process_with_one_line(event_log, settings, fault, tmp_path):
    """Before: a failing stream task left the process alive, archiving nothing, silent until SIGTERM."""
    run = settings.run_id
    await event_log.append(_reward(run, 0))
    env = _env(settings, run, flush_interval_s=0.2)
    if fault == "credentials_refused":
        env["SPRAWL_BLOBS__SECRET_ACCESS_KEY"] = "not-the-secret"
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "archiver"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        if fault == "consumer_deleted":
            blobs = open_blob_store(settings.blobs)
            await _until(lambda: blobs.list_keys(run_prefix(run)), "the first file archived")
            consumer = consumer_for(run, ConsumerRole.ARCHIVER, METRICS)
            await event_log.js.delete_consumer(METRICS.name, consumer.name)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            _kill(proc)
    assert proc.returncode not in (0, None)
    errors = [line for line in stderr.decode().splitlines() if line.startswith("sprawl: error:")]
    assert len(errors) == 1, stderr.decode()
    wanted = {"consumer_deleted": f"{run}-archiver-metrics", "credentials_refused": "S3 refused ListObjectsV2"}[fault]
    assert wanted in errors[0]


# ---------------------------------------------------------------- progress per message: kills


async def test_a_file_written_but_never_acked_is_not_written_again(event_log, settings):
    """A crash between PUT and ack, exactly: a file holds some messages (not a dense range: the metrics
    stream interleaves heartbeats and junk) whose acks never came. The next archiver acks their
    redeliveries without writing them, and writes the rest."""
    run = settings.run_id
    await _publish_mixed(event_log, run, 10)
    blobs = open_blob_store(settings.blobs)
    consumer = consumer_for(run, ConsumerRole.ARCHIVER, METRICS)
    sub = await event_log.js.pull_subscribe_bind(durable=consumer.name, stream=METRICS.name)
    dying = StreamArchiver(
        event_log, blobs, run, METRICS, ArchiveSection(), ArchivedSeqs(), Waits(ArchiveSection()), 30.0
    )
    stop = asyncio.Event()
    for msg in await sub.fetch(100, timeout=HANG_GUARD_S):
        await dying._take(msg, stop)
    written = [(p.event_type, p.row) for p in dying.buffer.values() if p.event_type != UNDECODABLE]
    (file,) = archive_files(run, METRICS, written)
    assert not file.key.dense
    blobs.put_bytes(file.to_parquet(), file.key.to_key())
    await sub.unsubscribe()  # and dies: nothing acked

    counts = await _log_counts(event_log, run)
    assert await drain_once(_settings(settings)) == sum(counts.values()) - len(written)
    _assert_archive_is_the_log(settings, run, counts)


KILL_POINTS = ["before_any_put", "after_the_first_put", "after_several_puts"]


@pytest.mark.parametrize("kill_point", KILL_POINTS)
async def test_sigkill_of_the_archiver_loses_no_row_and_writes_none_twice(event_log, settings, kill_point, tmp_path):
    """Before: the restarted archiver wrote newer messages first, raised its high-water mark and acked
    the older redelivered ones unwritten (214 rows lost after one kill)."""
    run = new_run_id()
    await apply(event_log.js, settings.streams, run)
    await _publish_mixed(event_log, run, 40)
    blobs = open_blob_store(settings.blobs)

    def files() -> int:
        return len(ArchiveKey.parse_listing(blobs.list_keys(run_prefix(run))))

    log_path = tmp_path / "archiver.log"
    if kill_point == "before_any_put":
        first = _start_archiver(_env(settings, run, flush_interval_s=3600, flush_events=100_000), log_path)

        async def all_delivered() -> bool:
            """Every message of the log (the dead letters the archiver appends included) is out to it."""
            counts = await _log_counts(event_log, run)
            delivered = 0
            for stream in STREAMS:
                consumer = consumer_for(run, ConsumerRole.ARCHIVER, stream)
                delivered += (await event_log.js.consumer_info(stream.name, consumer.name)).num_ack_pending
            return delivered == sum(counts.values()) and counts == await _log_counts(event_log, run)

        await _until(all_delivered, "every message delivered to the first archiver")
        assert files() == 0
    else:
        first = _start_archiver(_env(settings, run, flush_interval_s=0.2, flush_events=5, fetch_batch=3), log_path)
        enough = 1 if kill_point == "after_the_first_put" else 5
        await _until(lambda: files() >= enough, f"{enough} files written")
    _kill(first)
    assert first.returncode == -signal.SIGKILL

    await _publish_mixed(event_log, run, 20, start=40)  # newer messages, delivered before the redeliveries
    second = _start_archiver(_env(settings, run, flush_interval_s=0.2, flush_events=7), log_path)
    try:

        async def all_acked() -> bool:
            return await _pending(event_log, run) == 0

        await _until(all_acked, "every message acked")  # and acked only once written
    finally:
        second.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(second.wait, HANG_GUARD_S)
    assert rc == 0, log_path.read_text()[-4000:]
    _assert_archive_is_the_log(settings, run, await _log_counts(event_log, run))


async def test_claim_checked_events_count_by_their_own_size_toward_a_flush(event_log, settings):
    """A burst of large (claim-checked) events is flushed by bytes, not held until 5000 of them or the
    interval: each counts as the event it stands for, not as its few hundred bytes of claim."""
    run = settings.run_id
    for i in range(4):
        await event_log.append(big_trajectory(run, f"big{i}", 9_000))  # ~0.37 MiB encoded: claim-checked
    consumer = consumer_for(run, ConsumerRole.ARCHIVER, TRAJECTORIES)
    sub = await event_log.js.pull_subscribe_bind(durable=consumer.name, stream=TRAJECTORIES.name)
    section = ArchiveSection(flush_events=5000, flush_interval_s=3600.0, flush_bytes=1 << 20)
    archiver = StreamArchiver(
        event_log, open_blob_store(settings.blobs), run, TRAJECTORIES, section, ArchivedSeqs(), Waits(section), 30.0
    )
    stop = asyncio.Event()
    due = []
    msgs = await sub.fetch(4, timeout=HANG_GUARD_S)
    assert all(len(m.data) < 4096 for m in msgs)  # claim checks on the log
    for msg in msgs:
        await archiver._take(msg, stop)
        due.append(archiver._flush_due())
    assert archiver.buffered_bytes > 4 * 300_000
    assert due == [False, False, True, True]  # past 1 MiB at the third
    await archiver.flush(stop)
    assert archiver.buffered_bytes == 0 and not archiver._flush_due()
    await sub.unsubscribe()
