"""A consumer process for crash tests, with an idempotent handler.

The handler's side effect is one S3 object per event id (`ledger/<run>/<event_id>`):
it writes only if the object is absent, and appends one line to
`<workdir>/applied` when it does and one to `<workdir>/invocations` on every call.
With `--hang-on ID` it blocks after applying that trajectory, so a test can
SIGKILL it between side effect and ack.

Run: python -m tests.ledger_consumer --workdir DIR [--hang-on ID] (settings from SPRAWL_* env).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path

from pipeline.blobstore import S3BlobStore
from pipeline.config import SprawlSettings, load_settings
from pipeline.consumer import Consumer, Delivery
from pipeline.eventlog import EventLog
from pipeline.logs import configure_logging
from pipeline.topology import ConsumerRole, consumer_for


def _append_line(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def ledger_handler(blobs: S3BlobStore, workdir: Path, hang_on: str | None):
    async def handle(delivery: Delivery) -> None:
        event = delivery.event
        _append_line(workdir / "invocations", event.event_id)
        key = f"ledger/{event.run_id}/{event.event_id}"
        if not await asyncio.to_thread(blobs.exists, blobs.uri(key)):
            await asyncio.to_thread(blobs.put_bytes, event.trajectory_id.encode(), key)
            _append_line(workdir / "applied", event.event_id)
        if hang_on is not None and event.trajectory_id == hang_on:
            (workdir / "hanging").write_text(str(os.getpid()))
            await asyncio.sleep(3600)

    return handle


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--hang-on", default=None)
    args = parser.parse_args()
    settings = load_settings(SprawlSettings)
    configure_logging(settings.run_id, fmt="json", level="WARNING")
    event_log = await EventLog.connect(settings, worker="ledger-consumer")
    blobs = S3BlobStore(settings.blobs)
    # It stands in for a reward worker, so it binds the reward workers' consumer.
    rewards = consumer_for(settings.run_id, ConsumerRole.REWARDS)
    consumer = Consumer(
        event_log,
        rewards.stream.name,
        rewards.name,
        ledger_handler(blobs, args.workdir, args.hang_on),
        fetch_timeout_s=0.2,
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await consumer.run(stop)
    await event_log.close()


if __name__ == "__main__":
    asyncio.run(main())
