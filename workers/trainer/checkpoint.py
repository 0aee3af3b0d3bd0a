"""Trainer state checkpoints: the whole state to S3 (blob first), then a checkpoint event.

A checkpoint holds what the log cannot re-derive cheaply: master weights, optimizer moments, every
RNG, the version and step, the trajectories already used, and the stream positions to resume
the feeds from. Versions published after it are re-derived from their lineage (`recovery.py`).
An unavailable store is waited out by the upload (`blobs.outage_patience_s`), the event after it.
"""

from __future__ import annotations

import asyncio
import io
import random
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.blobstore import BlobStore
from pipeline.eventlog import EventLog
from pipeline.log_lookup import last_event_on
from pipeline.logs import get_logger
from pipeline.subjects import trainer_checkpoint_subject
from pipeline.topology import TRAINER
from schemas import TrainerCheckpoint

log = get_logger(__name__)


@dataclass(frozen=True)
class RestoredState:
    version: int
    step: int
    used: set[str]
    trajectory_position: int
    reward_position: int


async def latest_checkpoint(event_log: EventLog, run_id: str) -> TrainerCheckpoint | None:
    """The run's newest checkpoint; None only when the log says there is none."""
    last = await last_event_on(event_log, TRAINER.name, trainer_checkpoint_subject(run_id))
    if last is None:
        return None
    if not isinstance(last.event, TrainerCheckpoint):
        raise TypeError(f"the checkpoint subject holds a {type(last.event).type_tag()} event")
    return last.event


async def save_checkpoint(
    event_log: EventLog,
    blobs: BlobStore,
    *,
    run_id: str,
    holder: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    version: int,
    step: int,
    used: set[str],
    positions: tuple[int, int],
) -> None:
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(),
            "version": version,
            "step": step,
            "used": sorted(used),
        },
        buffer,
    )
    key = f"runs/{run_id}/trainer/ckpt-v{version:08d}-{holder}.pt"
    ref = await asyncio.to_thread(blobs.put_bytes, buffer.getvalue(), key)
    await _append_checkpoint(event_log, run_id, version, step, ref, positions)
    log.info("checkpointed", version=version, bytes=ref.bytes)


async def _append_checkpoint(event_log: EventLog, run_id: str, version: int, step: int, ref, positions) -> None:
    """The checkpoint event, after its blob is stored."""
    await event_log.append(
        TrainerCheckpoint(
            run_id=run_id,
            version=version,
            step=step,
            uri=ref.uri,
            sha256=ref.checksum,
            bytes=ref.bytes,
            trajectory_position=positions[0],
            reward_position=positions[1],
        )
    )


async def restore_checkpoint(
    blobs: BlobStore, ckpt: TrainerCheckpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> RestoredState:
    """Load weights, moments and RNGs in place (the blob is verified against the event's digest)."""
    data = await asyncio.to_thread(blobs.get_bytes, ckpt.uri, expected=ckpt.sha256)
    # Our own blob, verified by digest: it holds RNG states that only the full unpickler restores.
    state = torch.load(io.BytesIO(data), weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    np.random.set_state(state["numpy_rng"])
    log.info("restored checkpoint", version=state["version"], step=state["step"])
    return RestoredState(
        version=state["version"],
        step=state["step"],
        used=set(state["used"]),
        trajectory_position=ckpt.trajectory_position,
        reward_position=ckpt.reward_position,
    )


# ---------------------------------------------------------------- several ranks


async def save_sharded_checkpoint(
    event_log: EventLog,
    blobs: BlobStore,
    training,
    *,
    run_id: str,
    holder: str,
    version: int,
    step: int,
    used: set[str],
    positions: tuple[int, int],
) -> None:
    """Rank 0 of a sharded trainer: every rank writes its torch.distributed.checkpoint shards and
    uploads them (`RankTraining.save_sharded`); then a manifest naming every file with its digest
    (and what only rank 0 knows: the step and the trajectories used) is the checkpoint's blob, and
    the event follows it. A rank that dies midway leaves files without a manifest: no event, so
    recovery uses the previous checkpoint."""
    from workers.trainer.ranks import checkpoint_manifest

    files = await asyncio.to_thread(training.save_sharded, run_id, holder, version)
    manifest = checkpoint_manifest(files, version=version, step=step, used=used, world_size=training.ctx.world_size)
    key = f"runs/{run_id}/trainer/ckpt-v{version:08d}-{holder}/manifest.json"
    ref = await asyncio.to_thread(blobs.put_bytes, manifest, key)
    await _append_checkpoint(event_log, run_id, version, step, ref, positions)
    log.info("checkpointed", version=version, bytes=sum(f["bytes"] for f in files), ranks=training.ctx.world_size)


async def restore_any_checkpoint(blobs: BlobStore, ckpt: TrainerCheckpoint, training) -> RestoredState:
    """Restore a checkpoint written by one process (`save_checkpoint`) or by several ranks (a manifest of
    torch.distributed.checkpoint files). Weights move between the two only through the chain: a
    single process cannot load a sharded one, nor ranks a single one (CheckpointFormatMismatch)."""
    from workers.trainer.ranks import CheckpointFormatMismatch, checked_manifest

    data = await asyncio.to_thread(blobs.get_bytes, ckpt.uri, expected=ckpt.sha256)
    sharded = data[:1] == b"{"
    manifest = checked_manifest(data, ckpt.version) if sharded else None
    if sharded != training.ctx.distributed:
        written = f"{manifest['world_size']} ranks" if manifest else "one process"
        raise CheckpointFormatMismatch(
            f"checkpoint of version {ckpt.version} was written by {written}; this trainer has"
            f" {training.ctx.world_size} rank(s)",
            hint="restart with trainer.ranks > 1 for a sharded checkpoint (any number of ranks reshards it),"
            " or with one rank for a single-process one",
        )
    if not sharded:
        return await restore_checkpoint(blobs, ckpt, training.model, training.optimizer)
    assert manifest is not None
    if manifest.get("version") != ckpt.version:
        raise CheckpointFormatMismatch(
            f"the checkpoint event says version {ckpt.version}, its manifest {manifest.get('version')}",
            hint="the manifest blob was replaced: restore an older checkpoint or start the run anew",
        )
    await asyncio.to_thread(training.restore_sharded, manifest["files"])
    log.info("restored checkpoint", version=manifest["version"], step=manifest["step"], ranks=manifest["world_size"])
    return RestoredState(
        version=manifest["version"],
        step=manifest["step"],
        used=set(manifest["used"]),
        trajectory_position=ckpt.trajectory_position,
        reward_position=ckpt.reward_position,
    )
