"""The trainer on a real stack: versions with lineage, metrics per sampler group, one trainer per run,
and SIGKILL recovery whose versions are bit-identical to an uninterrupted run's."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pipeline.blobstore import S3BlobStore
from pipeline.lease import LeaseHeld
from pipeline.replay import replay
from pipeline.version_log import fetch_version
from schemas import PolicyVersion, TrainerMetrics
from tests.chain_helpers import signed_trust
from tests.servers import HANG_GUARD_S, connection_env, new_run_id
from tests.trainer_data import make_groups, publish_groups, write_initial_model
from workers.trainer.loop import Trainer
from workers.trainer.settings import TrainerSection, TrainerSettings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_model(tmp_path_factory.mktemp("initial"))


def _settings(settings, model_dir, **trainer) -> TrainerSettings:
    section = TrainerSection(model_dir=model_dir, groups_per_batch=2, trainer_id="t-main", **trainer)
    return TrainerSettings(
        **settings.model_dump(include={"run_id", "nats", "blobs", "log", "streams"}),
        trust=signed_trust(),
        trainer=section,
    )


async def test_updates_publish_versions_with_lineage_and_metrics(event_log, settings, model_dir):
    await publish_groups(event_log, make_groups(model_dir, settings.run_id, 6))
    trainer = Trainer(
        _settings(settings, model_dir, max_versions=3, checkpoint_every=2), event_log, S3BlobStore(settings.blobs)
    )
    await asyncio.wait_for(trainer.run(asyncio.Event()), HANG_GUARD_S)
    assert trainer.published == [0, 1, 2, 3]
    used = []
    blobs = S3BlobStore(settings.blobs)
    for version in (1, 2, 3):
        event = await fetch_version(event_log, settings.run_id, version)
        assert isinstance(event, PolicyVersion) and event.consumed_trajectories == 8
        lineage = json.loads(blobs.get_bytes(event.lineage_uri))
        assert [g["group_id"] for g in lineage["groups"]] == [f"g{2 * (version - 1)}", f"g{2 * (version - 1) + 1}"]
        used += [m[0] for g in lineage["groups"] for m in g["members"]]
    assert len(used) == len(set(used)) == 24
    metrics = [r.event async for r in replay(event_log, "METRICS", f"rl.{settings.run_id}.metrics.>")]
    assert [m.version for m in metrics if isinstance(m, TrainerMetrics)] == [1, 2, 3]
    m = metrics[0]
    for key in (
        "kl_k1",
        "kl_k3",
        "chi2",
        "ess_ratio",
        "masked_low",
        "masked_high",
        "entropy",
        "grad_norm",
        "reward_mean",
        "reward_std",
        "format_error_rate",
        "truncation_rate",
        "tokens_per_s",
        "staleness_0",
    ):
        assert key in m.metrics, key
    assert set(m.per_group) == {"bf16", "fp8_e4m3"}
    assert m.metrics["format_error_rate"] == 0.25 and m.metrics["truncation_rate"] == 0.25
    checkpoints = [r.event async for r in replay(event_log, "TRAINER", f"rl.{settings.run_id}.trainer.checkpoint")]
    assert [c.version for c in checkpoints] == [2]


async def test_a_second_trainer_fails_fast(event_log, settings, model_dir):
    first = Trainer(_settings(settings, model_dir), event_log, S3BlobStore(settings.blobs))
    await first.lease.take()
    second = Trainer(
        _settings(settings, model_dir).model_copy(
            update={"trainer": TrainerSection(model_dir=model_dir, trainer_id="t-other")}
        ),
        event_log,
        S3BlobStore(settings.blobs),
    )
    with pytest.raises(LeaseHeld, match="already has a trainer \\(t-main\\)"):
        await second.lease.take()


def _env(settings, run_id, model_dir, checkpoint_every, max_versions) -> dict:
    return {
        **os.environ,
        "SPRAWL_RUN_ID": run_id,
        **connection_env(settings, "trainer", run_id),
        "SPRAWL_LOG_FORMAT": "json",
        "SPRAWL_TRAINER__MODEL_DIR": str(model_dir),
        "SPRAWL_TRAINER__GROUPS_PER_BATCH": "2",
        "SPRAWL_TRAINER__TRAINER_ID": "t-proc",
        "SPRAWL_TRAINER__CHECKPOINT_EVERY": str(checkpoint_every),
        "SPRAWL_TRAINER__MAX_VERSIONS": str(max_versions),
        "SPRAWL_CHAIN__VIEWS": '["bf16", "fp8_e4m3"]',
        "SPRAWL_TRUST__SIGNING_KEY_FILE": str(signed_trust().signing_key_file),
    }


async def _roots(event_log, run_id, versions) -> list[dict[str, str]]:
    roots = []
    for v in range(versions + 1):
        event = await fetch_version(event_log, run_id, v)
        assert event is not None, f"version {v} missing"
        roots.append({view.view: view.root_hash for view in event.views})
    return roots


async def test_sigkill_and_resume_publishes_bit_identical_versions(event_log, settings, model_dir):
    from infra.streams import apply

    versions = 6
    runs = {}
    for name in ("straight", "killed"):
        run_id = new_run_id()
        await apply(event_log.js, settings.streams, run_id)
        await publish_groups(event_log, make_groups(model_dir, run_id, 2 * versions))
        runs[name] = run_id
    cmd = [sys.executable, "-m", "workers.cli", "trainer"]
    straight = subprocess.run(
        cmd, env=_env(settings, runs["straight"], model_dir, 2, versions), timeout=300, capture_output=True, text=True
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    env = _env(settings, runs["killed"], model_dir, 2, versions)
    victim = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while await fetch_version(event_log, runs["killed"], 3) is None:
            assert time.monotonic() < deadline and victim.poll() is None
            await asyncio.sleep(0.02)
        victim.send_signal(signal.SIGKILL)  # after the v2 checkpoint, mid-run
        victim.wait(timeout=10)
    finally:
        if victim.poll() is None:
            victim.kill()
    resumed = subprocess.run(cmd, env=env, timeout=300, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert '"restored checkpoint"' in resumed.stderr and '"version": 2' in resumed.stderr
    assert '"re-derived version from lineage"' in resumed.stderr  # v3 (at least) came back from lineage
    a = await _roots(event_log, runs["straight"], versions)
    b = await _roots(event_log, runs["killed"], versions)
    assert a == b
    print("recovery root hashes:", json.dumps(b))
