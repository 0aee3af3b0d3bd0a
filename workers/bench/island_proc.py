"""One island process for `sprawl bench sync`: follows the chain and prints a JSON line per commit.

Run: python -m workers.bench.island_proc (settings from SPRAWL_* env, island section included). Who the
island is on the log and the blob store:
- `SPRAWL_BENCH_JOIN_TOKEN` set (`--wan`: an island in a namespace of its own): what the token says, as
  `sprawl sampler --join` does (in the environment, not argv: a token is a credential);
- else its role's identity on the secure stack under `SPRAWL_STATE_DIR` (the private stack's), or the
  settings as given on a stack without identities.
It pins the version key of `trust.version_public_key` like every island.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

from infra import stack
from pipeline.config import load_settings
from pipeline.eventlog import EventLog
from pipeline.logs import configure_logging
from pipeline.version_signing import island_trust
from workers.sampler.island import build_island
from workers.sampler.worker import SamplerSettings

JOIN_TOKEN_VARIABLE = "SPRAWL_BENCH_JOIN_TOKEN"


def island_settings() -> SamplerSettings:
    settings = load_settings(SamplerSettings)
    # Before anything logs (taking an identity does): stdout carries the commits, logs go to stderr.
    configure_logging(settings.run_id, fmt="json", level="WARNING")
    token = os.environ.get(JOIN_TOKEN_VARIABLE)
    if token:
        from infra.join_token import join_settings

        return load_settings(SamplerSettings, **join_settings(token, settings.state_dir))
    return stack.with_role(settings, "sampler")


async def main() -> None:
    settings = island_settings()
    trust = island_trust(settings.trust)
    event_log = await EventLog.connect(settings, worker="bench-island")
    island = build_island(event_log, settings.blobs, settings.run_id, settings.island, trust)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await island.start()
    reported: set[int] = set()
    print(json.dumps({"ready": True}), flush=True)
    while not stop.is_set():
        for commit in sorted(island.stats.recent, key=lambda c: c.version):
            if commit.version not in reported:
                reported.add(commit.version)
                print(
                    json.dumps(
                        {
                            "version": commit.version,
                            "committed_at": commit.committed_at,
                            "pause_s": commit.pause_s,
                            "root_hash": commit.root_hash,
                            "route": commit.route,
                            "written_bytes": commit.written_bytes,
                            "changed_tensor_bytes": commit.changed_tensor_bytes,
                            "build_s": commit.build_s,
                        }
                    ),
                    flush=True,
                )
        await asyncio.sleep(0.005)
    await island.stop()
    await event_log.close()
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
