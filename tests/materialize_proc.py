"""Materialize one version in a separate process; print the result as JSON (for concurrency tests).

Run: python -m tests.materialize_proc CACHE_DIR VERSION (settings from SPRAWL_* env).
"""

import asyncio
import json
import sys
from pathlib import Path

from pipeline.blobstore import open_blob_store
from pipeline.config import MaterializeSettings, SprawlSettings, load_settings
from pipeline.eventlog import EventLog
from pipeline.logs import configure_logging
from pipeline.materialize import Materializer


async def main(cache_dir: Path, version: int) -> None:
    settings = load_settings(SprawlSettings)
    configure_logging(settings.run_id, fmt="json", level="WARNING")
    event_log = await EventLog.connect(settings, worker="materialize-test")
    try:
        materializer = Materializer(
            event_log,
            open_blob_store(settings.blobs),
            run_id=settings.run_id,
            view="bf16",
            settings=MaterializeSettings(cache_dir=cache_dir),
        )
        got = await materializer.materialize(version)
    finally:
        await event_log.close()
    print(json.dumps({"root_hash": got.root_hash, "downloaded_bytes": got.downloaded_bytes, "route": got.route}))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2])))
