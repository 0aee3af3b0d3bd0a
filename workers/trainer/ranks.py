"""What every rank of the trainer holds and does: the model, the optimizer, the publisher's share.

Rank 0 is the trainer the log sees (the lease, the feeds, the lineage, the version events); the
other ranks have no connection to the log. Everything that all ranks must do together (an update,
capturing a version's weights, a checkpoint, a restore, the root hashes of re-derived weights) goes
through `RankTraining`: on rank 0 each call first broadcasts the command, so the others run the same
calls in the same order (`follow_leader`). With one rank nothing is broadcast and the model is not
sharded: the single-process trainer is the same code with world size 1.

Publishing runs beside the updates on every rank: rank 0's background publisher and a thread on each
other rank take the captured versions in order, agree on the kind (keyframe or patch), publish their
own units, and rank 0 gathers the parts and appends the event (`RankPublisher`). The parts travel on
a process group of their own, so they never interleave with the training's collectives.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import tempfile
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.batching import GroupBatchItem
from pipeline.bits import root_hash
from pipeline.blobstore import BlobStore
from pipeline.chain_publish import ChainPublisher
from pipeline.errors import SprawlError
from pipeline.logs import get_logger
from pipeline.model_construction import MODEL_CONSTRUCTION
from workers.trainer.distributed import (
    RankContext,
    gather_owned,
    gather_owned_shards,
    is_sharded,
    local_shards,
    shard_model,
)
from workers.trainer.recovery import view_digests
from workers.trainer.settings import TrainerSettings
from workers.trainer.update import UpdateMetrics, run_update, slice_count

log = get_logger(__name__)

SHARDED_CHECKPOINT_FORMAT = "sprawl-dcp-v1"
"""The manifest of a checkpoint written by several ranks (torch.distributed.checkpoint files)."""


class CheckpointFormatMismatch(SprawlError):
    """A checkpoint written by a sharded trainer restored by a single process, or the reverse."""


def load_model(settings: TrainerSettings, ctx: RankContext) -> torch.nn.Module:
    """The initial policy in fp32 (the masters), sharded over the ranks when there are several."""
    from transformers import AutoModelForCausalLM

    with MODEL_CONSTRUCTION:  # transformers switches torch's process-wide default dtype meanwhile
        model = AutoModelForCausalLM.from_pretrained(settings.trainer.model_dir, dtype=torch.float32)
    if ctx.device.type != "cpu":
        model = model.to(ctx.device)
    if ctx.distributed:
        model = shard_model(model, ctx)
    return model


def source_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Every state-dict entry's global shape (a sharded parameter reports its whole shape)."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


@dataclass
class Command:
    kind: str
    args: tuple = ()


class RankTraining:
    """The model and optimizer of this rank, and the operations all ranks run together."""

    def __init__(self, settings: TrainerSettings, ctx: RankContext, blobs: BlobStore):
        self.settings = settings
        self.cfg = settings.trainer
        self.ctx = ctx
        self.blobs = blobs
        slice_count(self.cfg, ctx)  # every rank refuses a slice count the ranks cannot share, at once
        self.model = load_model(settings, ctx)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.learning_rate, weight_decay=self.cfg.weight_decay
        )
        self.owner_of: dict[str, int] = {}

    # ---------------------------------------------------------------- commands

    def _tell(self, kind: str, *args: Any) -> None:
        """Rank 0: tell the other ranks what to run next (they block in `follow_leader` until told)."""
        if self.ctx.distributed and self.ctx.is_leader:
            dist.broadcast_object_list([Command(kind, args)], src=0)

    def plan_owners(self, publisher: ChainPublisher) -> None:
        layout = publisher.layout
        self.owner_of = {n: r for r in range(self.ctx.world_size) for n in layout.owned(r, self.ctx.world_size)}
        state = self.model.state_dict()
        self.shapes = {n: tuple(t.shape) for n, t in state.items()}
        self.sharded = {n for n, t in state.items() if is_sharded(t)}

    def gather_captured(self, captured: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """From a capture's shard copies, the full tensors this rank publishes: the gather to each owner,
        on the publish group (it runs in the publish thread, beside the next update)."""
        return gather_owned_shards(
            dict(captured), self.shapes, self.sharded, self.owner_of, self.ctx, group=self.ctx.publish_group
        )

    def update(
        self, batch: list[GroupBatchItem], trainer_version: int, quarantined: frozenset[str]
    ) -> UpdateMetrics | None:
        self._tell("update", batch, trainer_version, quarantined)
        return run_update(self.model, self.optimizer, batch, self.cfg, trainer_version, quarantined, self.ctx)

    def capture(self) -> Mapping[str, torch.Tensor]:
        """The weights of the version just computed: with one rank the live state dict (the background
        publisher copies it); with several, CPU copies of this rank's shards, which the publish path turns
        into the full tensors this rank owns (`gather_captured`) while the next update runs."""
        self._tell("capture")
        if not self.ctx.distributed:
            return self.model.state_dict()
        return local_shards([(n, t) for n, t in self.model.state_dict().items() if n in self.owner_of])

    def root_hashes(self) -> dict[str, str] | None:
        """Each view's manifest root hash for the current weights (rank 0; None on the others). Every
        rank hashes the views of the parameters it owns; the digests meet on rank 0."""
        self._tell("root_hashes")
        owned = self.capture_quietly()
        tie = bool(self.model.config.to_dict().get("tie_word_embeddings", False))
        digests = view_digests(
            owned, self.settings.chain.views, tie_word_embeddings=tie, model_type=self.model.config.model_type
        )
        if self.ctx.distributed:
            gathered: list[Any] | None = [None] * self.ctx.world_size if self.ctx.is_leader else None
            dist.gather_object(digests, gathered, dst=0)
            if not self.ctx.is_leader:
                return None
            assert gathered is not None
            merged = {name: sorted(d for part in gathered for d in part[name]) for name in self.settings.chain.views}
        else:
            merged = {name: sorted(d) for name, d in digests.items()}
        return {name: root_hash(d) for name, d in merged.items()}

    def capture_quietly(self) -> Mapping[str, torch.Tensor]:
        """`capture` without a command (inside one the other ranks already run)."""
        if not self.ctx.distributed:
            return self.model.state_dict()
        named = [(n, t) for n, t in self.model.state_dict().items() if n in self.owner_of]
        return gather_owned(named, self.owner_of, self.ctx)

    def stop(self) -> None:
        self._tell("stop")

    def keep_waiting(self) -> None:
        """Rank 0, idle: a command that does nothing, so the others' wait for the next one never times out."""
        self._tell("wait")

    # ---------------------------------------------------------------- sharded checkpoints

    def save_sharded(self, run_id: str, holder: str, version: int) -> list[dict[str, Any]] | None:
        """torch.distributed.checkpoint: every rank writes its shards of the weights and the optimizer
        state to a local folder and uploads what it wrote; rank 0 gets every rank's file list."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._tell("save_sharded", run_id, holder, version)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        prefix = f"runs/{run_id}/trainer/ckpt-v{version:08d}-{holder}"
        files = []
        with tempfile.TemporaryDirectory(prefix=f"sprawl-ckpt-r{self.ctx.rank}-") as tmp:
            dcp.save({"model": model_state, "optimizer": optimizer_state}, storage_writer=dcp.FileSystemWriter(tmp))
            for path in sorted(Path(tmp).iterdir()):
                ref = self.blobs.put_file(path, f"{prefix}/{path.name}")
                files.append({"name": path.name, "uri": ref.uri, "sha256": ref.checksum, "bytes": ref.bytes})
        gathered: list[Any] | None = [None] * self.ctx.world_size if self.ctx.is_leader else None
        # On the storage group: each rank's uploads may wait out a store outage apart from the others'.
        dist.gather_object(files, gathered, dst=0, group=self.ctx.storage_group)
        if not self.ctx.is_leader:
            return None
        assert gathered is not None
        return [f for rank_files in gathered for f in rank_files]

    def restore_sharded(self, files: list[dict[str, Any]]) -> None:
        """Every rank downloads the checkpoint's files (each verified by its digest) and loads its shards
        (torch.distributed.checkpoint reshards a checkpoint written by another number of ranks)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        self._tell("restore_sharded", files)
        with tempfile.TemporaryDirectory(prefix=f"sprawl-restore-r{self.ctx.rank}-") as tmp:
            for f in files:
                name = Path(f["name"]).name  # a name from the manifest never leaves the folder
                self.blobs.get_to_file(f["uri"], Path(tmp) / name, expected=f["sha256"])
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            dcp.load(state, storage_reader=dcp.FileSystemReader(tmp))
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )


# ---------------------------------------------------------------- publishing across ranks


def agree_on_keyframe(local: bool, ctx: RankContext) -> bool:
    """Any rank's "this must be a keyframe" (no history after a restart, every K) wins."""
    if not ctx.distributed:
        return local
    flag = torch.tensor([1 if local else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.publish_group)
    return bool(flag.item())


class RankPublisher:
    """`ChainPublisher.publish` for a trainer of several ranks, called with this rank's captured share.

    Rank 0 appends (after gathering every rank's part); the others publish their part and move their
    head. Versions are published in order on every rank (rank 0's background publisher, the other
    ranks' publish thread), and the parts' gathers use the publish process group."""

    def __init__(self, chain: ChainPublisher, training: RankTraining):
        self.chain = chain
        self.training = training
        self.ctx = training.ctx

    @property
    def head(self) -> int | None:
        return self.chain.head

    async def open(self) -> int | None:
        return await self.chain.open()

    def close(self) -> None:
        self.chain.close()

    async def publish(self, version: int, captured: Mapping[str, torch.Tensor], **event_fields: Any):
        """`captured`: this rank's shard copies of `version` (`RankTraining.capture`)."""
        owned = await asyncio.to_thread(self.training.gather_captured, captured)
        keyframe = await asyncio.to_thread(agree_on_keyframe, self.chain.needs_keyframe(version), self.ctx)
        part = await self.chain.publish_part(
            version, owned, rank=self.ctx.rank, world_size=self.ctx.world_size, keyframe=keyframe
        )
        parts = await asyncio.to_thread(self._gather, part)
        if not self.ctx.is_leader:
            self.chain.advance(version)
            return None
        assert parts is not None
        return await self.chain.append_parts(version, parts, **event_fields)

    def _gather(self, part: Any) -> list[Any] | None:
        gathered: list[Any] | None = [None] * self.ctx.world_size if self.ctx.is_leader else None
        dist.gather_object(part, gathered, dst=0, group=self.ctx.publish_group)
        return gathered


@dataclass
class _Start:
    writer_id: str
    head: int | None


def start_followers(publisher: ChainPublisher, ctx: RankContext) -> None:
    """Rank 0, once the chain's head is known: the other ranks build their publishers with the same
    writer id (one version's blobs under one prefix) and the same head."""
    if ctx.distributed:
        dist.broadcast_object_list([Command("start", (_Start(publisher.writer_id, publisher.head),))], src=0)


def extra_files(model_dir: Path) -> dict[str, bytes]:
    """What a keyframe ships beside the weights: the tokenizer and generation config of the model."""
    return {
        p.name: p.read_bytes()
        for p in model_dir.iterdir()
        if p.name.startswith(("tokenizer", "generation_config", "special_tokens", "chat_template")) and p.is_file()
    }


def follow_leader(settings: TrainerSettings, ctx: RankContext, blobs: BlobStore) -> None:
    """A rank other than 0: run rank 0's commands until it says stop. A failure here (or in the publish
    thread) ends this process with an error: torchrun then stops every rank and restarts the job."""
    training = RankTraining(settings, ctx, blobs)
    publish_queue: queue.Queue[tuple[int, Mapping[str, torch.Tensor]] | None] = queue.Queue()
    publisher: RankPublisher | None = None
    thread: threading.Thread | None = None
    version = 0
    while True:
        received: list[Any] = [None]
        dist.broadcast_object_list(received, src=0)
        command: Command = received[0]
        if command.kind == "start":
            start: _Start = command.args[0]
            chain = ChainPublisher(
                None,  # type: ignore[arg-type]  # a follower never touches the log: rank 0 appends
                blobs,
                run_id=settings.run_id,
                model_config=training.model.config.to_dict(),
                settings=settings.chain,
                extra_files=extra_files(settings.trainer.model_dir),
                writer_id=start.writer_id,
                source_shapes=source_shapes(training.model),
            )
            chain.start_at(start.head)
            training.plan_owners(chain)
            publisher = RankPublisher(chain, training)
            version = -1 if start.head is None else start.head
            thread = threading.Thread(target=_publish_loop, args=(publisher, publish_queue), daemon=True)
            thread.start()
        elif command.kind == "update":
            training.update(*command.args)
        elif command.kind == "capture":
            version += 1
            publish_queue.put((version, training.capture()))
        elif command.kind == "root_hashes":
            training.root_hashes()
        elif command.kind == "save_sharded":
            training.save_sharded(*command.args)
        elif command.kind == "restore_sharded":
            training.restore_sharded(*command.args)
        elif command.kind == "wait":
            continue
        elif command.kind == "stop":
            publish_queue.put(None)
            if thread is not None:
                thread.join()
            return
        else:
            raise SprawlError(f"rank {ctx.rank} got an unknown command {command.kind!r} from rank 0")


def _publish_loop(publisher: RankPublisher, pending: queue.Queue) -> None:
    try:
        while (item := pending.get()) is not None:
            version, weights = item
            asyncio.run(publisher.publish(version, weights))
    except BaseException as exc:  # any failure must end the process, loudly
        log.error("publishing this rank's part failed: stopping the rank", error=repr(exc))
        os._exit(1)


def new_writer_id() -> str:
    return uuid.uuid4().hex[:12]


class CheckpointManifestInvalid(SprawlError):
    """A sharded checkpoint's manifest that this trainer did not write (or that was tampered with)."""


DCP_FILE = re.compile(r"(\.metadata|__(\d+)_(\d+)\.distcp)")
"""The names torch.distributed.checkpoint's FileSystemWriter gives its files: one .metadata, and
`__<rank>_<n>.distcp` per rank."""


def checked_manifest(data: bytes, version: int) -> dict[str, Any]:
    """The manifest of a sharded checkpoint, refused (naming the entry) unless it is exactly what
    `save_sharded` writes: plain file names of torch.distributed.checkpoint's own form, each with a
    digest, the .metadata file and one or more data files from every rank that wrote it, no repeats."""

    def bad(what: str) -> CheckpointManifestInvalid:
        return CheckpointManifestInvalid(
            f"the manifest of the checkpoint of version {version}: {what}",
            hint="the blob was not written by a sprawl trainer (or was replaced): restore an older checkpoint"
            " by removing this one's event from consideration, or start the run anew",
        )

    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != SHARDED_CHECKPOINT_FORMAT:
        raise bad(f"not a {SHARDED_CHECKPOINT_FORMAT} manifest")
    world = manifest.get("world_size")
    if not isinstance(world, int) or world < 2:
        raise bad(f"world_size {world!r} is not a number of ranks")
    for key, kind in (("version", int), ("step", int), ("used", list), ("files", list)):
        if not isinstance(manifest.get(key), kind):
            raise bad(f"{key!r} is missing or not a {kind.__name__}")
    names: set[str] = set()
    writers: set[int] = set()
    for entry in manifest["files"]:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not DCP_FILE.fullmatch(name):
            raise bad(f"file entry {name!r} is not a torch.distributed.checkpoint file name")
        if name in names:
            raise bad(f"file {name!r} is listed twice")
        if not all(isinstance(entry.get(k), t) for k, t in (("uri", str), ("sha256", str), ("bytes", int))):
            raise bad(f"file {name!r} lacks its uri, digest or size")
        names.add(name)
        match = DCP_FILE.fullmatch(name)
        if match and match.group(2) is not None:
            writers.add(int(match.group(2)))
    if ".metadata" not in names:
        raise bad("no .metadata file")
    missing = sorted(set(range(world)) - writers)
    if missing or writers - set(range(world)):
        expected = ", ".join(f"__{r}_0.distcp" for r in missing) or "none"
        raise bad(f"data files of ranks {sorted(writers)} for {world} ranks (missing: {expected})")
    return manifest


def checkpoint_manifest(
    files: list[dict[str, Any]], *, version: int, step: int, used: set[str], world_size: int
) -> bytes:
    return json.dumps(
        {
            "format": SHARDED_CHECKPOINT_FORMAT,
            "version": version,
            "step": step,
            "used": sorted(used),
            "world_size": world_size,
            "files": files,
        },
        sort_keys=True,
    ).encode()
