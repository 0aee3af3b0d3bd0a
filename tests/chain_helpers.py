"""Helpers for version-chain tests: a publisher over a tiny model, and what each version must be."""

from __future__ import annotations

import torch

from pipeline.bits import checksum, dtype_name, root_hash, to_bits
from pipeline.blobstore import S3BlobStore
from pipeline.chain_publish import ChainPublisher
from pipeline.config import ChainSettings, MaterializeSettings
from pipeline.eventlog import EventLog
from pipeline.materialize import Materializer
from pipeline.views import get_view


def expected_root(state_dict: dict[str, torch.Tensor], view: str) -> str:
    tensors = get_view(view).compute(state_dict)
    return root_hash([(n, dtype_name(t.dtype), tuple(t.shape), checksum(to_bits(t))) for n, t in tensors.items()])


def publisher(event_log: EventLog, settings, model, **chain) -> ChainPublisher:
    return ChainPublisher(
        event_log,
        S3BlobStore(settings.blobs),
        run_id=settings.run_id,
        model_config=model.config.to_dict(),
        settings=ChainSettings(**chain),
        extra_files={"generation_config.json": b"{}"},
    )


def materializer(event_log: EventLog, settings, cache_dir, view: str = "bf16", **kw) -> Materializer:
    return Materializer(
        event_log,
        S3BlobStore(settings.blobs),
        run_id=settings.run_id,
        view=view,
        settings=MaterializeSettings(cache_dir=cache_dir, **kw),
    )
