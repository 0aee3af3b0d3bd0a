"""One island process for `sprawl bench sync`: follows the chain and prints a JSON line per commit.

Run: python -m workers.bench.island_proc (settings from SPRAWL_* env, island section included).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from pipeline.config import load_settings
from pipeline.eventlog import EventLog
from pipeline.logs import configure_logging
from workers.sampler.island import build_island
from workers.sampler.worker import SamplerSettings


async def main() -> None:
    settings = load_settings(SamplerSettings)
    configure_logging(settings.run_id, fmt="json", level="WARNING")
    event_log = await EventLog.connect(settings, worker="bench-island")
    island = build_island(event_log, settings.blobs, settings.run_id, settings.island)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await island.start()
    reported: set[int] = set()
    print(json.dumps({"ready": True}), flush=True)
    while not stop.is_set():
        for version, at in sorted(island.stats.committed_at.items()):
            if version not in reported:
                reported.add(version)
                pause = island.stats.pause_by_version[version]
                print(
                    json.dumps(
                        {
                            "version": version,
                            "committed_at": at,
                            "pause_s": pause,
                            "root_hash": island.stats.root_hashes[version],
                            "route": island.stats.routes[version],
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
