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
    log.info("checkpointed", version=version, bytes=ref.bytes)


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
