"""The trainer as two torchrun ranks on a real stack: the chain equals a one-process trainer's (same
data, same slices), checkpoints are sharded, and a SIGKILLed rank restarts the job, which recovers
from the sharded checkpoint and the lineage to the same bits."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.blobstore import S3BlobStore
from pipeline.replay import replay
from pipeline.version_log import fetch_version
from tests.chain_helpers import signed_trust
from tests.servers import HANG_GUARD_S, connection_env, new_run_id
from tests.trainer_data import make_groups, publish_groups, write_initial_model

pytestmark = pytest.mark.integration

VERSIONS = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_model(tmp_path_factory.mktemp("initial"))


def _env(settings, run_id, model_dir, **trainer) -> dict:
    env = {
        **os.environ,
        "SPRAWL_RUN_ID": run_id,
        **connection_env(settings, "trainer", run_id),
        "SPRAWL_LOG_FORMAT": "json",
        "PYTHONUNBUFFERED": "1",  # two ranks share the output: lines written whole, not cut at a buffer's end
        "SPRAWL_TRAINER__MODEL_DIR": str(model_dir),
        "SPRAWL_TRAINER__GROUPS_PER_BATCH": "2",
        "SPRAWL_TRAINER__MICRO_BATCHES": "2",
        "SPRAWL_TRAINER__TRAINER_ID": "t-ranks",
        "SPRAWL_TRAINER__CHECKPOINT_EVERY": "2",
        "SPRAWL_TRAINER__MAX_VERSIONS": str(VERSIONS),
        "SPRAWL_CHAIN__VIEWS": '["bf16", "fp8_e4m3"]',
        "SPRAWL_TRUST__SIGNING_KEY_FILE": str(signed_trust().signing_key_file),
    }
    env.update({f"SPRAWL_TRAINER__{k.upper()}": str(v) for k, v in trainer.items()})
    return env


async def _views(event_log, run_id) -> list[dict]:
    """Per version and view: what must not depend on the number of ranks (URIs carry the writer id).
    `served` is what an island serves; `files` also the blobs, which differ after a restart (the first
    version a restarted trainer publishes is a keyframe: it has no previous bits to patch from)."""
    out = []
    for v in range(VERSIONS + 1):
        event = await fetch_version(event_log, run_id, v)
        assert event is not None, f"version {v} missing"
        out.append(
            {
                view.view: {
                    "served": (view.root_hash, [(t.name, t.dtype, t.shape, t.xxh3) for t in view.tensors]),
                    "files": (view.kind, [(b.name, b.sha256, b.bytes) for b in view.blobs]),
                }
                for view in event.views
            }
        )
    return out


def _json_line(line: str) -> dict | None:
    """A log line as JSON; None for what is not one (two ranks share the output: a line may hold the
    end of one rank's line and another's)."""
    if not line.startswith("{"):
        return None
    try:
        return json.loads(line)
    except ValueError:
        return None


def _rank_pids(run_id: str, rank: int) -> list[int]:
    """Processes of this run's trainer with torchrun's RANK=rank (from their environment)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        launched = any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in environ)
        if launched and f"SPRAWL_RUN_ID={run_id}".encode() in environ and f"RANK={rank}".encode() in environ:
            pids.append(int(proc.name))
    return pids


async def test_two_ranks_publish_one_process_chain_and_recover_from_a_killed_rank(event_log, settings, model_dir):
    from infra.streams import apply

    runs = {}
    for name in ("one", "two"):
        run_id = new_run_id()
        await apply(event_log.js, settings.streams, run_id)
        await publish_groups(event_log, make_groups(model_dir, run_id, 2 * VERSIONS))
        runs[name] = run_id
    cmd = [sys.executable, "-m", "workers.cli", "trainer"]
    one = subprocess.run(cmd, env=_env(settings, runs["one"], model_dir), timeout=600, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]

    env = _env(settings, runs["two"], model_dir, ranks=2, max_restarts=2)
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while await fetch_version(event_log, runs["two"], 3) is None:
            assert time.monotonic() < deadline and job.poll() is None, "no version 3 from the 2-rank job"
            await asyncio.sleep(0.05)
        victims = _rank_pids(runs["two"], 1)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)  # after the v2 checkpoint, mid-run
        output, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, "\n".join(ln for ln in output.splitlines() if "error" in ln.lower())[-6000:]
    lines = [event for line in output.splitlines() if (event := _json_line(line)) is not None]
    restored = [ln for ln in lines if ln.get("event") == "restored checkpoint"]
    assert restored and restored[-1]["ranks"] == 2 and restored[-1]["version"] >= 2, output[-3000:]
    assert any(ln.get("event") == "re-derived version from lineage" for ln in lines)

    # Every version serves the same bits as one process's (the restart re-derived its way back), and the
    # versions published before the kill are the same files too.
    one_views, two_views = await _views(event_log, runs["one"]), await _views(event_log, runs["two"])
    assert [{k: v["served"] for k, v in x.items()} for x in one_views] == [
        {k: v["served"] for k, v in x.items()} for x in two_views
    ]
    assert one_views[:4] == two_views[:4]
    # The two-rank job's checkpoints are sharded: a manifest of every rank's files.
    blobs = S3BlobStore(settings.blobs)
    checkpoints = [r.event async for r in replay(event_log, "TRAINER", f"rl.{runs['two']}.trainer.checkpoint")]
    assert checkpoints
    manifest = json.loads(blobs.get_bytes(checkpoints[-1].uri, expected=checkpoints[-1].sha256))
    assert manifest["world_size"] == 2 and len([f for f in manifest["files"] if f["name"].endswith(".distcp")]) == 2


@pytest.mark.slow
async def test_a_single_process_refuses_a_sharded_checkpoint(event_log, settings, model_dir, tmp_path):
    """A run checkpointed by two ranks, restarted as one process: a clear error, not a wrong state."""
    from infra.streams import apply

    run_id = new_run_id()
    await apply(event_log.js, settings.streams, run_id)
    await publish_groups(event_log, make_groups(model_dir, run_id, 4))
    cmd = [sys.executable, "-m", "workers.cli", "trainer"]
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=0, max_versions=2)
    two = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-3000:]
    env = _env(settings, run_id, model_dir, max_versions=2)
    one = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
    assert one.returncode != 0
    assert "was written by 2 ranks" in one.stderr and "trainer.ranks" in one.stderr
