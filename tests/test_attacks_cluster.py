"""Attacks on the 3-node log cluster and the blob store's outage handling, by an independent tester.

Each test tries to make the cluster lose an acknowledged event, store one twice, or serve a wrong bit,
and checks that it does not: a retry of the same event across a leader change is a duplicate, a log
without quorum refuses appends loudly and keeps every acknowledged one, a fixed route port that is
taken stops `stack up` before any server starts, a write the store refuses or finds corrupt is not
waited out as an outage, and `stack down` leaves no server process alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import signal
import socket
import time
from collections import Counter

import pytest
from pydantic import SecretStr

from infra import stack
from infra.nats_server import node_for_server_name
from infra.server_process import binary_of, is_nats_node, pid_alive
from infra.streams import apply
from pipeline.blobstore import open_blob_store
from pipeline.blobstore.outage import blob_store_waits
from pipeline.errors import (
    AppendFailed,
    AppendUnavailable,
    BlobIntegrityError,
    BlobStoreError,
    BlobStoreUnavailable,
    StackError,
)
from pipeline.eventlog import EventLog
from pipeline.topology import PROMPTS
from tests.servers import HANG_GUARD_S, auto_stack_settings, running_cluster
from workers.bench.failover_bench import stream_placement, wait_placed
from workers.bench.failover_probe import probe_group, scan_patiently


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("attack-cluster"), "attack") as settings:
        yield settings


async def _declared_log(cluster, run_id: str, worker: str) -> EventLog:
    event_log = await EventLog.connect(cluster.model_copy(update={"run_id": run_id}), worker)
    await apply(event_log.js, cluster.streams, run_id)
    await wait_placed(event_log, PROMPTS.name, 3, HANG_GUARD_S)
    return event_log


async def _new_leader(event_log: EventLog, old: str) -> str:
    """Wait until the prompts stream has a leader other than `old` (asked again mid-election)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            leader, _, _ = await stream_placement(event_log, PROMPTS.name)
            if leader and leader != old:
                return leader
        await asyncio.sleep(0.2)
    raise AssertionError(f"no new leader for {PROMPTS.name} after {old} was killed")


def _kill(cluster, server_name: str) -> None:
    record = stack.read_state(stack.stack_dir(cluster)).server(node_for_server_name(server_name))
    os.kill(record.pid, signal.SIGKILL)


async def _repair(cluster, event_log: EventLog) -> None:
    """`stack up` on the half-dead cluster, then every replica current again (for the next test)."""
    repaired = await asyncio.to_thread(stack.up, cluster)
    assert sum(1 for s in repaired.servers if is_nats_node(s)) == 3
    await wait_placed(event_log, PROMPTS.name, 3, HANG_GUARD_S)


async def _stored_ids(event_log: EventLog, run_id: str) -> Counter:
    stored = await scan_patiently(event_log, run_id, HANG_GUARD_S)  # the API may pause after a leader change
    return Counter(m.event.event_id for m in stored if m.event is not None)


async def test_an_event_retried_after_its_leader_died_is_a_duplicate_not_a_second_event(cluster):
    """The ack of an append that landed is lost with its leader; the producer retries the same events
    (same Nats-Msg-Id) on the new leader: the followers replicated the dedup state, so nothing is
    stored twice."""
    run_id = "dedup-across-leaders"
    event_log = await _declared_log(cluster, run_id, "attacker")
    try:
        events = [probe_group(run_id, k) for k in range(12)]
        first = [await event_log.append(event) for event in events]
        assert not any(r.duplicate for r in first)
        leader, _, _ = await stream_placement(event_log, PROMPTS.name)
        _kill(cluster, leader)
        await _new_leader(event_log, leader)
        again = []
        for event in events:  # what a producer whose acks were lost does: the same events again
            with contextlib.suppress(AppendUnavailable):  # mid-reconnect: asked again below
                again.append(await event_log.append(event, patience_s=HANG_GUARD_S))
        assert all(r.duplicate for r in again), [r for r in again if not r.duplicate]
        assert [r.seq for r in again] == [r.seq for r in first], "each retry named the position it landed at"
        stored = await _stored_ids(event_log, run_id)
        assert stored == Counter({e.event_id: 1 for e in events})
        await _repair(cluster, event_log)
        assert await _stored_ids(event_log, run_id) == stored, "the restarted node changed nothing"
    finally:
        await event_log.close()


@pytest.mark.slow
async def test_without_quorum_an_append_fails_loudly_and_every_acked_event_survives(cluster):
    """Two of three servers die: the log must refuse appends (never ack one it cannot keep); once they
    are back, every acknowledged event is there once and the refused one, appended again, lands once."""
    run_id = "no-quorum"
    event_log = await _declared_log(cluster, run_id, "attacker")
    try:
        acked = [probe_group(run_id, k) for k in range(5)]
        for event in acked:
            await event_log.append(event)
        _, followers, _ = await stream_placement(event_log, PROMPTS.name)
        for victim in followers:  # the leader stays, alone: it may not commit anything
            _kill(cluster, victim)
        refused = probe_group(run_id, 99)
        # Loud, never acked. (Its class is AppendUnavailable, or AppendFailed when a retry meets the
        # first attempt's proposal still pending: "duplicate message id is in process", err 10158.)
        with pytest.raises(AppendFailed):
            await event_log.append(refused)
        await _repair(cluster, event_log)
        landed = None
        for _ in range(20):  # the pending proposal may still be "in process" while quorum returns
            with contextlib.suppress(AppendFailed):
                landed = await event_log.append(refused, patience_s=HANG_GUARD_S)
                break
            await asyncio.sleep(0.5)
        assert landed is not None, "the refused event could be appended again once quorum was back"
        stored = await _stored_ids(event_log, run_id)
        assert stored == Counter({e.event_id: 1 for e in [*acked, refused]}), (landed, stored)
    finally:
        await event_log.close()


def test_a_taken_route_port_stops_stack_up_before_any_server_starts(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        # The second node's route port is the taken one: every node's port is checked, not the first's.
        settings = auto_stack_settings(tmp_path, "clash", nats_cluster=3, nats_cluster_port=taken - 1)
        with pytest.raises(StackError, match=f"port {taken} .*routes"):
            stack.up(settings)
    assert stack.read_state(stack.stack_dir(settings)) is None
    assert not list(stack.stack_dir(settings).glob("*.pid")), "no server was started"


def _counting_puts(store) -> list[int]:
    """Count the store's write attempts (each one a real PUT to SeaweedFS)."""
    calls: list[int] = []
    put_stream = store._put_stream

    def counted(*args, **kwargs):
        calls.append(1)
        return put_stream(*args, **kwargs)

    store._put_stream = counted
    return calls


def test_a_refused_write_is_not_waited_out_as_an_outage(cluster):
    wrong_secret = {"secret_access_key": SecretStr("not-the-secret"), "outage_patience_s": 600.0}
    blobs = cluster.blobs.model_copy(update=wrong_secret)
    store = open_blob_store(blobs)
    puts = _counting_puts(store)
    with pytest.raises(BlobStoreError) as refused:
        store.put_bytes(b"never stored", key="attacks/refused")
    assert not isinstance(refused.value, BlobStoreUnavailable), refused.value
    assert len(puts) == 1, "a refusal gets the same answer every time: one attempt"
    assert blob_store_waits() == []


def test_a_corrupt_write_is_not_retried_and_never_read_back(cluster):
    store = open_blob_store(cluster.blobs.model_copy(update={"outage_patience_s": 600.0}))
    puts = _counting_puts(store)
    data = b"the bytes we meant"
    wrong = hashlib.sha256(b"other bytes").hexdigest()  # a body that no longer matches its checksum
    key = "attacks/corrupt"
    try:
        store._ride_out_outage(lambda: store._put_stream(io.BytesIO(data), len(data), key, "sha256", wrong), key)
    except BlobStoreError as exc:
        assert not isinstance(exc, BlobStoreUnavailable), exc
        assert not store.exists(store.uri(key)), "the server kept a body it refused"
    else:  # the server kept it: then the reader must refuse it, never hand out the bytes
        with pytest.raises(BlobIntegrityError):
            store.get_bytes(store.uri(key))
    assert len(puts) == 1, "a corrupt body is no outage: one attempt"


def test_stack_down_leaves_no_server_process_alive(tmp_path):
    settings = auto_stack_settings(tmp_path, "down", nats_cluster=3, nats_cluster_port=0)
    running = stack.up(settings)
    servers = [(s.pid, binary_of(s.name)) for s in running.servers]
    try:
        assert len(servers) == 4 and all(pid_alive(pid, binary) for pid, binary in servers)
        os.kill(running.server("nats-2").pid, signal.SIGKILL)  # one died before the down
    finally:
        stack.down(settings)
    assert [pid for pid, binary in servers if pid_alive(pid, binary)] == []
    assert stack.read_state(stack.stack_dir(settings)) is None
    assert not list(stack.stack_dir(settings).glob("*.pid"))
