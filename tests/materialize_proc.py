"""Materialize one version in a separate process; print the result as JSON (for concurrency and crash tests).

Run: python -m tests.materialize_proc CACHE_DIR VERSION [--pin | --halt-after-first-apply]
(settings from SPRAWL_* env).

- `--pin`: materialize it pinned, as an island does before its engine loads it, print the result, and
  hold the pin until stdin is closed (another process's engine serving that version).
- `--halt-after-first-apply`: stop dead in the middle of the in-place apply (after the codec has written
  the first group of the first patch into the recycled slot), print `{"halted": true}` and wait to be
  killed: the crash the test then makes with SIGKILL happens at a known point, not at a guessed time.
"""

import asyncio
import json
import sys
import threading
from pathlib import Path

from pipeline import patch_codec
from pipeline.blobstore import open_blob_store
from pipeline.config import MaterializeSettings, SprawlSettings, load_settings
from pipeline.eventlog import EventLog
from pipeline.logs import configure_logging
from pipeline.materialize import Materializer


def halt_after_first_apply() -> None:
    apply_group = patch_codec.apply_group

    def apply_then_halt(*args, **kwargs):
        out = apply_group(*args, **kwargs)
        print(json.dumps({"halted": True}), flush=True)
        threading.Event().wait()  # until SIGKILL
        return out

    patch_codec.apply_group = apply_then_halt


async def main(cache_dir: Path, version: int, mode: str) -> None:
    settings = load_settings(SprawlSettings)
    configure_logging(settings.run_id, fmt="json", level="WARNING")
    if mode == "--halt-after-first-apply":
        halt_after_first_apply()
    event_log = await EventLog.connect(settings, worker="materialize-test")
    try:
        materializer = Materializer(
            event_log,
            open_blob_store(settings.blobs),
            run_id=settings.run_id,
            view="bf16",
            settings=MaterializeSettings(cache_dir=cache_dir),
        )
        got = await materializer.materialize(version, pin=mode == "--pin")
    finally:
        await event_log.close()
    print(
        json.dumps(
            {
                "root_hash": got.root_hash,
                "downloaded_bytes": got.downloaded_bytes,
                "route": got.route,
                "path": str(got.path),
            }
        ),
        flush=True,
    )
    if mode == "--pin":
        await asyncio.to_thread(sys.stdin.read)  # the pin is held until the test closes our stdin
        got.release()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else ""))
