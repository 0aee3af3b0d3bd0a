"""The faults: each acts on a running fleet and returns the moment it ended (UTC), when recovery starts.

A killed worker is restarted by the supervisor, as under `sprawl up`; a killed nats-server is started
again by the harness from the same store on the same port, as an operator (or systemd) would.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlparse

from pipeline.version_log import fetch_version
from workers.bench.faults.fleet import Fleet

Inject = Callable[[Fleet], Awaitable[datetime]]


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Inject
    description: str


def _now() -> datetime:
    return datetime.now(UTC)


def sigkill_worker(command: str) -> Inject:
    async def inject(fleet: Fleet) -> datetime:
        name = fleet.worker_names(command)[0]
        os.killpg(fleet.worker_pid(name), signal.SIGKILL)  # the worker and whatever it started (sandboxes)
        return _now()  # the supervisor restarts it after its backoff, as under `sprawl up`

    return inject


async def nats_sigkill_and_restart(fleet: Fleet) -> datetime:
    fleet.kill_server("nats")
    await asyncio.to_thread(fleet.restart_nats)
    return _now()


def nats_outage(seconds: float) -> Inject:
    async def inject(fleet: Fleet) -> datetime:
        fleet.kill_server("nats")
        await asyncio.sleep(seconds)
        await asyncio.to_thread(fleet.restart_nats)
        return _now()

    return inject


def seaweed_stopped(seconds: float) -> Inject:
    async def inject(fleet: Fleet) -> datetime:
        pid = fleet.server_pid("seaweedfs")
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        return _now()

    return inject


async def corrupt_patch(fleet: Fleet) -> datetime:
    """Overwrite the stored patch blobs of the newest version, then make an island need them: it is
    killed and its version cache wiped, so its restart must rebuild the chain through that patch."""
    from pipeline.blobstore import S3BlobStore

    version = await fleet.head_version()
    event = await fetch_version(fleet.event_log, fleet.run_id, version) if version else None
    if event is None or not all(v.kind == "patch" for v in event.views):
        raise RuntimeError(f"v{version} of {fleet.run_id} is not a patch version: nothing to corrupt")
    store = S3BlobStore(fleet.settings.blobs)
    for view in event.views:
        for blob in view.blobs:
            parsed = urlparse(blob.uri)
            await asyncio.to_thread(
                store.client.put_object,
                Bucket=parsed.netloc,
                Key=parsed.path.lstrip("/"),
                Body=b"corrupted by the fault suite " + os.urandom(64),
            )
    island = fleet.worker_names("sampler")[0]
    os.killpg(fleet.worker_pid(island), signal.SIGKILL)
    cache = fleet.island_dirs()[fleet.settings_of(island).island.island_id]
    await asyncio.to_thread(shutil.rmtree, cache.parent.parent, True)  # <islands>/<id>: everything it had
    return _now()


def catalogue(*, outage_s: float = 60.0, seaweed_stop_s: float = 20.0) -> list[Fault]:
    return [
        Fault("sigkill_trainer", sigkill_worker("trainer"), "SIGKILL the trainer; the supervisor restarts it"),
        Fault("sigkill_sampler", sigkill_worker("sampler"), "SIGKILL a sampler island; restarted"),
        Fault("sigkill_rewards", sigkill_worker("rewards"), "SIGKILL the reward worker; restarted"),
        Fault("sigkill_archiver", sigkill_worker("archiver"), "SIGKILL the archiver; restarted"),
        Fault("nats_sigkill_restart", nats_sigkill_and_restart, "SIGKILL nats-server, restart it from its store"),
        Fault(
            f"nats_outage_{outage_s:.0f}s",
            nats_outage(outage_s),
            f"nats-server down for {outage_s:.0f}s, then restarted from its store",
        ),
        Fault(
            f"seaweedfs_sigstop_{seaweed_stop_s:.0f}s",
            seaweed_stopped(seaweed_stop_s),
            f"SeaweedFS SIGSTOPped for {seaweed_stop_s:.0f}s, then SIGCONT",
        ),
        Fault("corrupt_patch", corrupt_patch, "the newest version's patch blobs overwritten; an island must rebuild"),
    ]


def fault_named(name: str, **timing: float) -> Fault:
    for fault in catalogue(**timing):
        if fault.name == name:
            return fault
    raise KeyError(f"no fault {name!r}; faults: {', '.join(f.name for f in catalogue(**timing))}")
