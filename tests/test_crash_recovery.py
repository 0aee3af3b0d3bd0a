"""A consumer SIGKILLed mid-handler, and a nats-server restarted under a running consumer."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from infra import stack
from infra.streams import apply
from pipeline.blobstore import S3BlobStore
from pipeline.consumer import Consumer
from pipeline.eventlog import EventLog
from tests.events import trajectory
from tests.ledger_consumer import ledger_handler
from tests.servers import HANG_GUARD_S, connection_env, restartable_stack

pytestmark = pytest.mark.integration


def _env(settings) -> dict[str, str]:
    return {
        **os.environ,
        "SPRAWL_RUN_ID": settings.run_id,
        **connection_env(settings),  # the ledger consumer binds the run's consumers and writes `ledger/`
    }


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def _wait_for(predicate, timeout_s: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _drained(event_log, stream: str, durable: str) -> bool:
    info = await event_log.js.consumer_info(stream, durable)
    return info.num_pending == 0 and info.num_ack_pending == 0


async def test_sigkill_mid_handler_redelivers_and_applies_once(event_log, settings, tmp_path):
    events = [trajectory(settings.run_id, f"k{n}", 3) for n in range(6)]
    for event in events:
        await event_log.append(event)
    durable = f"{settings.run_id}-rewards"
    cmd = [sys.executable, "-m", "tests.ledger_consumer", "--workdir", str(tmp_path)]
    victim = subprocess.Popen([*cmd, "--hang-on", "k3"], env=_env(settings))
    try:
        await _wait_for(lambda: (tmp_path / "hanging").exists() or victim.poll() is not None)
        assert victim.poll() is None, "the victim exited before it hung"
        # k3's side effect is done, its ack is not: the worst moment to die.
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
    finally:
        if victim.poll() is None:
            victim.kill()
    assert not await _drained(event_log, "TRAJECTORIES", durable)
    survivor = subprocess.Popen(cmd, env=_env(settings))
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not await _drained(event_log, "TRAJECTORIES", durable):
            assert time.monotonic() < deadline, "survivor did not drain the consumer"
            await asyncio.sleep(0.1)
    finally:
        survivor.send_signal(signal.SIGTERM)
        survivor.wait(timeout=HANG_GUARD_S)
    applied = Counter(_lines(tmp_path / "applied"))
    invocations = Counter(_lines(tmp_path / "invocations"))
    assert set(applied) == {e.event_id for e in events}
    assert all(count == 1 for count in applied.values()), applied
    assert invocations[events[3].event_id] == 2, "k3 was redelivered after the kill"
    ledger = S3BlobStore(settings.blobs).list_keys(f"ledger/{settings.run_id}/")
    assert len(ledger) == len(events)


@pytest.fixture
def private_stack(tmp_path):
    """A stack whose nats-server is restarted on the same port."""
    with restartable_stack(tmp_path) as settings:
        yield settings


def _restart_nats(settings) -> None:
    record = next(s for s in stack.status(settings).servers if s.name == "nats")
    argv = Path(f"/proc/{record.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while stack._pid_alive(record.pid, "nats-server") and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(record.pid, os.WNOHANG)
        time.sleep(0.05)
    log_file = open(record.log_file, "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [a.decode() for a in argv],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=Path(record.log_file).parent,
        start_new_session=True,
    )
    log_file.close()
    state = stack._state_file(stack.stack_dir(settings))
    state.write_text(state.read_text().replace(f'"pid": {record.pid}', f'"pid": {proc.pid}'))


async def test_nats_restart_between_publishes_loses_nothing_and_applies_once(private_stack, tmp_path):
    settings = private_stack
    event_log = await EventLog.connect(settings, worker="test-restart")
    await apply(event_log.js, settings.streams, settings.run_id)
    blobs = S3BlobStore(settings.blobs)
    handler = ledger_handler(blobs, tmp_path, hang_on=None)
    consumer = Consumer(event_log, "TRAJECTORIES", f"{settings.run_id}-rewards", handler, fetch_timeout_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        before = [trajectory(settings.run_id, f"before-{n}", 3) for n in range(5)]
        for event in before:
            await event_log.append(event)
        await _wait_for(lambda: len(_lines(tmp_path / "applied")) == 5)
        await asyncio.to_thread(_restart_nats, settings)
        after = [trajectory(settings.run_id, f"after-{n}", 3) for n in range(5)]
        for event in after:
            await event_log.append(event)  # retries with the same msg id while the client reconnects
        await _wait_for(lambda: len(set(_lines(tmp_path / "applied"))) == 10, timeout_s=60)
        await asyncio.sleep(3 * settings.streams.backoff_s[0])  # room for any stray redelivery
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=HANG_GUARD_S)
    applied = Counter(_lines(tmp_path / "applied"))
    assert set(applied) == {e.event_id for e in before + after}
    assert all(count == 1 for count in applied.values())
    info = await event_log.js.stream_info("TRAJECTORIES")
    assert info.state.messages == 10
    consumer_info = await event_log.js.consumer_info("TRAJECTORIES", f"{settings.run_id}-rewards")
    assert consumer_info.num_ack_pending == 0 and consumer_info.num_pending == 0
    await event_log.close()
