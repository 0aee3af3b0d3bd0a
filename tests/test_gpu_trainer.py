"""The trainer on CUDA (GPU machines only: `just test-gpu`; the same on CPU in the default suite): a
few bf16-autocast steps of the tiny MoE with fp32 masters, publishing bf16 and fp8 views that an
island on the same machine materializes bit-exactly; then a fresh model restored from a checkpoint
re-derives the later versions on the device and checks them against the root hashes in the log (what
CUDA's deterministic mode holds). Fails (does not skip) where torch sees no CUDA device."""

import asyncio

import pytest
import torch

from pipeline.blobstore import S3BlobStore
from pipeline.replay import replay
from pipeline.version_log import fetch_version
from tests.chain_helpers import materializer, signed_trust
from tests.servers import HANG_GUARD_S
from tests.trainer_data import make_groups, publish_groups, write_initial_model
from workers.trainer.checkpoint import restore_any_checkpoint
from workers.trainer.loop import Trainer, determinism
from workers.trainer.ranks import RankTraining
from workers.trainer.recovery import batch_from_lineage, check_rederived
from workers.trainer.settings import TrainerSection, TrainerSettings

pytestmark = pytest.mark.integration

VIEWS = ["bf16", "fp8_e4m3"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_model(tmp_path_factory.mktemp("initial"))


def _settings(settings, model_dir, max_versions: int, device: str) -> TrainerSettings:
    section = TrainerSection(
        model_dir=model_dir,
        groups_per_batch=2,
        trainer_id="t-gpu",
        device=device,
        precision="bf16",
        checkpoint_every=2,
        max_versions=max_versions,
    )
    return TrainerSettings(
        **settings.model_dump(include={"run_id", "nats", "blobs", "log", "streams"}),
        trust=signed_trust(),
        trainer=section,
        chain={"views": VIEWS},
    )


@pytest.mark.gpu
async def test_cuda_trainer_publishes_views_an_island_materializes_and_recovers_them(
    event_log, settings, model_dir, tmp_path
):
    if not torch.cuda.is_available():
        pytest.fail("torch sees no CUDA device: `just test-gpu` runs on a GPU machine with a CUDA build of torch")
    await _train_materialize_recover(event_log, settings, model_dir, tmp_path, "cuda")


async def test_cpu_bf16_trainer_publishes_views_an_island_materializes_and_recovers_them(
    event_log, settings, model_dir, tmp_path
):
    """The same on CPU, where bf16 autocast is bit-exact run to run: the default suite's check of the path."""
    await _train_materialize_recover(event_log, settings, model_dir, tmp_path, "cpu")


async def _train_materialize_recover(event_log, settings, model_dir, tmp_path, device: str) -> None:

    await publish_groups(event_log, make_groups(model_dir, settings.run_id, 8))
    first = _settings(settings, model_dir, 4, device)
    trainer = Trainer(first, event_log, S3BlobStore(settings.blobs), _context(device))
    await asyncio.wait_for(trainer.run(asyncio.Event()), HANG_GUARD_S)
    assert trainer.published == [0, 1, 2, 3, 4]
    assert next(trainer.model.parameters()).device.type == device
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 masters under autocast
    assert all(
        s.dtype == torch.float32 for state in trainer.optimizer.state.values() for s in state.values() if s.dim()
    )

    for view in VIEWS:  # an island on this machine: every version, bit-exact (the root hash is verified)
        island = materializer(event_log, settings, tmp_path / view, view=view)
        for version in range(5):
            built = await island.materialize(version)
            event = await fetch_version(event_log, settings.run_id, version)
            assert built.root_hash == next(v.root_hash for v in event.views if v.view == view)

    # Recovery on the GPU: a fresh model restored from the v2 checkpoint re-derives v3 and v4 from their
    # lineage and must hash to the root hashes in the log (RecoveryMismatch if CUDA were not deterministic).
    determinism(first.trainer)
    blobs = S3BlobStore(settings.blobs)
    training = RankTraining(first, _context(device), blobs)
    checkpoints = [r.event async for r in replay(event_log, "TRAINER", f"rl.{settings.run_id}.trainer.checkpoint")]
    await restore_any_checkpoint(blobs, next(c for c in checkpoints if c.version == 2), training)
    for version in (3, 4):
        event, batch, quarantined = await batch_from_lineage(event_log, blobs, settings.run_id, version)
        training.update(batch, version - 1, quarantined)
        check_rederived(event, training.root_hashes())


def _context(device: str):
    from workers.trainer.distributed import RankContext, rank_device

    return RankContext(device=rank_device(device, 0))
