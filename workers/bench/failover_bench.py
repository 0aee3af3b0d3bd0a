"""`sprawl bench failover`: what losing a log server, or the blob store, costs a run.

On a private 3-node JetStream cluster (`stack.nats_cluster = 3`, streams with 3 replicas) with
SeaweedFS beside it, each scenario runs the append probe (`failover_probe.py`: a producer appending
prompt groups, the samplers' consumer applying them) and injects one fault while it runs:

- `leader_kill`: SIGKILL the server leading the prompts stream; appends must resume after the
  election; the server is started again (`stack up` repairs it, on its ports, from its store) and
  must catch up;
- `follower_kill`: the same with a server that follows it;
- `leader_stall`: SIGSTOP that leader for as long as the S3 outage, then SIGCONT (a frozen machine:
  its connections stay open, only pings reveal it);
- `s3_outage`: SeaweedFS stopped for 30 s (`--quick`: 10 s) while every append goes through a claim
  check (the event's body is stored in S3 first), then started again.

Each reports `seconds_without_appends` (longest wait between two acknowledged appends; its
`baseline_max_gap_s` is the same figure before the fault), `lost` (acked, yet missing from the stream
or never applied) and `applied_twice` (a consumer's handler run twice for one event), plus
`stored_twice`. Goals: lost = 0, applied_twice = 0, stored_twice = 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from infra import stack
from infra.nats_server import node_for_server_name
from infra.stack import StackSection, StackSettings
from infra.streams import apply
from pipeline.errors import SprawlError
from pipeline.eventlog import NO_ANSWER, EventLog
from pipeline.logs import get_logger
from pipeline.topology import PROMPTS
from workers.bench.failover_probe import AppendProbe, FaultNeverHealed, ProbeOutcome

log = get_logger(__name__)

GUARD_S = 180.0
"""How long any awaited recovery may take before the scenario fails loudly (never a fixed wait)."""


def cluster_settings(state_dir: Path, *, nodes: int = 3) -> StackSettings:
    section = StackSection(
        nats_port=0,
        nats_monitor_port=0,
        nats_cluster_port=0,
        s3_port=0,
        seaweed_port_base=0,
        nats_cluster=nodes,
    )
    return StackSettings(run_id="failover", state_dir=state_dir, stack=section)


async def stream_placement(event_log: EventLog, stream: str) -> tuple[str, list[str], bool]:
    """(leader's server name, followers' server names, every follower current)."""
    info = await event_log.js.stream_info(stream)
    cluster = info.cluster
    if cluster is None or not cluster.leader:
        return "", [], False
    followers = [peer.name for peer in cluster.replicas or []]
    current = all(peer.current and not peer.offline for peer in cluster.replicas or [])
    return cluster.leader, followers, current


async def wait_placed(event_log: EventLog, stream: str, replicas: int, guard_s: float) -> tuple[str, list[str]]:
    """Wait until `stream` has a leader and `replicas - 1` current followers."""
    deadline = time.monotonic() + guard_s
    while True:
        with contextlib.suppress(Exception):  # mid-election the API may not answer: asked again
            leader, followers, current = await stream_placement(event_log, stream)
            if leader and len(followers) == replicas - 1 and current:
                return leader, followers
        if time.monotonic() > deadline:
            raise FaultNeverHealed(f"stream {stream} did not get {replicas} current replicas within {guard_s:.0f}s")
        await asyncio.sleep(0.2)


Fault = Callable[[StackSettings, EventLog], Awaitable[float | None]]
"""Injects a fault and returns once it is on (the probe measures from there); a fault that ends by
itself (an outage) returns how long the service was down, start to healthy again."""


async def run_scenario(
    settings: StackSettings,
    fault: Fault,
    heal: Fault,
    *,
    pad_bytes: int = 0,
    acks: int = 20,
    guard_s: float = GUARD_S,
) -> ProbeOutcome:
    """The probe under one fault: warm up, inject, await resumed appends, heal, await catching up."""
    run_id = f"failover-{uuid.uuid4().hex[:8]}"
    run = settings.model_copy(update={"run_id": run_id})
    if pad_bytes:  # every append then stores its body in S3 first (a claim check)
        run = run.model_copy(update={"log": run.log.model_copy(update={"claim_check_threshold_bytes": 1024})})
    producer = await EventLog.connect(run, "failover-producer")
    consumer_log = await EventLog.connect(run, "failover-consumer")
    probe = AppendProbe(producer, consumer_log, run_id, pad_bytes=pad_bytes)
    try:
        await _apply_patiently(producer, run, guard_s)
        replicas = settings.stack.nats_cluster if settings.stack.nats_cluster >= 3 else 1
        if replicas > 1:
            await wait_placed(producer, PROMPTS.name, 3, guard_s)
        await probe.start()
        await probe.wait_acks(acks, guard_s=guard_s, what="warm-up")
        fault_at = time.monotonic()
        down_s = await fault(settings, producer)
        await probe.wait_acks(acks, after=fault_at, guard_s=guard_s, what="appends after the fault")
        await heal(settings, producer)
        healed_at = time.monotonic()
        if replicas > 1:
            await wait_placed(producer, PROMPTS.name, 3, guard_s)
        await probe.wait_acks(acks, after=healed_at, guard_s=guard_s, what="appends after healing")
        await probe.stop_appending()
        await probe.wait_applied(guard_s)
        outcome = await probe.outcome(fault_at, guard_s)
        outcome.down_s = down_s
        return outcome
    finally:
        await probe.stop()
        await producer.close()
        await consumer_log.close()


async def _apply_patiently(event_log: EventLog, run: StackSettings, guard_s: float) -> None:
    """Declare the run's streams and consumers; right after a server rejoined, the JetStream API may not
    answer for a while (its meta layer catching up): asked again until the guard runs out."""
    deadline = time.monotonic() + guard_s
    while True:
        try:
            await apply(event_log.js, run.streams, run.run_id, log=run.log, nats=run.nats)
            return
        except NO_ANSWER as exc:
            if time.monotonic() > deadline:
                raise FaultNeverHealed(f"the JetStream API did not answer within {guard_s:.0f}s: {exc!r}") from exc
            log.info("stream declaration waits for the cluster", error=repr(exc))
            await asyncio.sleep(1.0)


def _pid_of(settings: StackSettings, server_name: str) -> int:
    """The pid of the cluster node a stream placement names (`sprawl_local_2`, ...)."""
    status = stack.status(settings)
    if status is None:
        raise SprawlError("the cluster is not running", hint="a scenario before this one left it half-dead")
    return status.server(node_for_server_name(server_name)).pid


def kill_stream_server(which: str) -> Fault:
    """SIGKILL the server that leads (`leader`) or follows (`follower`) the prompts stream."""

    async def inject(settings: StackSettings, event_log: EventLog) -> None:
        leader, followers = await wait_placed(event_log, PROMPTS.name, 3, GUARD_S)
        victim = leader if which == "leader" else followers[0]
        pid = _pid_of(settings, victim)
        log.warning("SIGKILL", server=victim, role=which, pid=pid)
        os.kill(pid, signal.SIGKILL)

    return inject


def stall_stream_leader(seconds: float) -> Fault:
    """SIGSTOP the prompts stream's leader for `seconds`, then SIGCONT: a frozen machine, whose TCP
    connections stay open, so only the clients' unanswered pings and the cluster's missed heartbeats
    reveal it. Returns how long it was frozen."""

    async def inject(settings: StackSettings, event_log: EventLog) -> float:
        leader, _ = await wait_placed(event_log, PROMPTS.name, 3, GUARD_S)
        pid = _pid_of(settings, leader)
        log.warning("SIGSTOP", server=leader, pid=pid, seconds=seconds)
        started = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)  # the stall's length is the fault itself
        finally:
            os.kill(pid, signal.SIGCONT)
        return time.monotonic() - started

    return inject


async def nothing(settings: StackSettings, event_log: EventLog) -> None:
    """No healing needed: the fault ended by itself."""


async def restart_dead(settings: StackSettings, event_log: EventLog) -> None:
    """`sprawl stack up` on the half-dead stack: the dead server starts again on its ports."""
    await asyncio.to_thread(stack.up, settings)


def stop_blob_store(seconds: float) -> Fault:
    """SeaweedFS stopped for `seconds` (the probe keeps appending: its claim checks must wait)."""

    async def inject(settings: StackSettings, event_log: EventLog) -> None:
        status = stack.status(settings)
        if status is None:
            raise SprawlError("the stack is not running")
        await asyncio.to_thread(stack.stop_servers, [status.server("seaweedfs")])
        await asyncio.sleep(seconds)  # the outage's length is the fault itself, not a wait for an event

    return inject


async def failover_figures(state_dir: Path, *, outage_s: float) -> dict[str, ProbeOutcome]:
    settings = cluster_settings(state_dir)
    running = stack.up(settings)
    settings = stack.with_endpoints(settings, running)
    scenarios: dict[str, tuple[Fault, int]] = {
        "leader_kill": (kill_stream_server("leader"), 0),
        "follower_kill": (kill_stream_server("follower"), 0),
        "leader_stall": (stall_stream_leader(outage_s), 0),
        "s3_outage": (_seaweed_outage_probe(outage_s), 2048),
    }
    figures = {}
    try:
        for name, (fault, pad_bytes) in scenarios.items():
            heal = nothing if name == "leader_stall" else restart_dead
            figures[name] = await run_scenario(settings, fault, heal, pad_bytes=pad_bytes)
            log.info("failover scenario", scenario=name, **figures[name].summary())
        return figures
    finally:
        stack.down(settings)


def _seaweed_outage_probe(seconds: float) -> Fault:
    """The outage, returning when it is over and the store is back (the probe's "appends after the
    fault" then counts appends that waited through it)."""
    stop = stop_blob_store(seconds)

    async def inject(settings: StackSettings, event_log: EventLog) -> float:
        started = time.monotonic()
        await stop(settings, event_log)
        await restart_dead(settings, event_log)
        return time.monotonic() - started

    return inject


def bench_failover(quick: bool = False) -> tuple[list[dict], dict]:
    outage_s = 10.0 if quick else 30.0
    with tempfile.TemporaryDirectory(prefix="sprawl-failover-") as tmp:
        figures = asyncio.run(failover_figures(Path(tmp), outage_s=outage_s))
    rows = [{"scenario": name, **outcome.summary()} for name, outcome in figures.items()]
    summary: dict = {name: outcome.summary() for name, outcome in figures.items()}
    summary["nodes"] = 3
    summary["s3_outage"]["outage_s"] = outage_s
    summary["meets_goals"] = all(o.lost == 0 and o.applied_twice == 0 and o.stored_twice == 0 for o in figures.values())
    return rows, summary
