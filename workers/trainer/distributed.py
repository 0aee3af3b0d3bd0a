"""The trainer's ranks: torch.distributed set-up, FSDP2 sharding, and the two collectives that must
not depend on the number of ranks (the gradient norm and the publish gather).

A trainer of N ranks is launched by `torchrun` (`sprawl trainer --trainer.ranks N` does it on one
host). Every rank holds a shard of the master weights and of the optimizer state (FSDP2's
`fully_shard`, dim-0 shards); each update's batch is cut into slices and every rank computes the
gradient of its own. What makes N ranks publish the same bits as one process:

- gradients are *summed* across ranks (no FSDP averaging: the loss is already normalized by the
  whole batch's token count), and a sum of two terms is the same in either order, so two ranks give
  exactly the gradient that one process accumulating the same two slices gives;
- the gradient norm for clipping is reduced in a canonical order (one float64 partial per dim-0 row,
  gathered and summed as one vector) that is the same for every N, where a norm of local norms
  would differ in the last bits;
- AdamW is elementwise, so a step on a shard equals the step on the whole tensor, bit for bit.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeline.errors import SprawlError
from pipeline.logs import get_logger

log = get_logger(__name__)


class RanksMisconfigured(SprawlError):
    """The torchrun environment and the trainer's settings disagree."""


@dataclass
class RankContext:
    """This process's place among the trainer's ranks. World size 1 is the single-process trainer: no
    process group, every collective a no-op."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    publish_group: Any = None
    """A second process group for the publish thread, whose collectives run beside the training's."""
    storage_group: Any = None
    """A third, for the collectives of a sharded checkpoint that follow each rank's own uploads."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ)


def init_ranks(device: str, timeout_s: float, store_wait_s: float = 0.0) -> RankContext:
    """Join the process group torchrun describes (gloo on CPU, NCCL on CUDA). `store_wait_s`: how long
    one rank's write to the blob store may wait out an outage (`blob_store_wait_s`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if world == 1:
        return RankContext(device=rank_device(device, local))
    torch_device = rank_device(device, local)
    backend = "nccl" if torch_device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across the restarts of a job, and the process group's keys
        # (each rank's address) are not per attempt: after a restart a rank would read its peer's address
        # from the attempt before and fail to connect. One prefix per attempt keeps them apart.
        agent_store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"sprawl-trainer/attempt-{attempt}", agent_store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    # Gloo for the publish thread on every device: it only ships small objects and the parts' gathers,
    # and a separate group keeps its collectives from interleaving with the training's. Its collectives
    # (and a checkpoint's, on a third group) come right after each rank's own uploads, and every rank
    # waits out an unavailable store on its own (with its own backoff): a peer may arrive that much
    # later without anything being wrong.
    after_uploads = datetime.timedelta(seconds=timeout_s + store_wait_s)
    publish_group = dist.new_group(backend="gloo", timeout=after_uploads)
    storage_group = dist.new_group(backend="gloo", timeout=after_uploads)
    log.info("trainer rank joined", rank=rank, world_size=world, backend=backend, device=str(torch_device))
    return RankContext(
        rank=rank, world_size=world, device=torch_device, publish_group=publish_group, storage_group=storage_group
    )


def blob_store_wait_s(outage_patience_s: float) -> float:
    """The longest one write to the blob store may take while the store is down: the patience, then
    one more backoff before the attempt that gives up or lands."""
    from pipeline.blobstore.outage import MAX_RETRY_S

    return outage_patience_s + MAX_RETRY_S


def rank_device(name: str, local_rank: int) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RanksMisconfigured(
                "trainer.device is cuda but torch sees no CUDA device",
                hint="install a CUDA build of torch on a GPU machine, or set trainer.device = 'cpu'",
            )
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def shard_model(model: torch.nn.Module, ctx: RankContext) -> torch.nn.Module:
    """FSDP2: each decoder layer is one unit (gathered for its forward and backward, then freed), the
    root holds the rest. Gradients are summed across ranks (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise RanksMisconfigured(
            f"{type(model).__name__} has no `model.layers`: cannot shard it per decoder layer",
            hint="sharded training supports decoder-only causal LMs with the usual transformers layout",
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # A plain sum: gloo has no pre-multiplied sum, and an average would divide twice.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly FSDP-sharded) tensor; the tensor itself when not sharded."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def is_sharded(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "to_local")


def _row_chunks(rows: int, world: int) -> list[int]:
    """Rows of each rank's dim-0 shard, as FSDP2 cuts them (torch.chunk: ceil-sized, the last short or
    empty)."""
    size = -(-rows // world) if rows else 0
    out = []
    left = rows
    for _ in range(world):
        take = min(size, left)
        out.append(take)
        left -= take
    return out


def gradient_norm(params: list[torch.nn.Parameter], ctx: RankContext) -> torch.Tensor:
    """The global L2 norm of the gradients, the same float for every number of ranks.

    One float64 sum of squares per dim-0 row (a row is whole on one rank; squares of float32 are exact
    in float64), gathered into one vector in row order, summed once. Parameters without a gradient
    count zero."""
    partials = []
    for p in params:
        grad = p.grad
        if grad is None:
            rows = _row_chunks(p.shape[0] if p.dim() else 1, ctx.world_size)[ctx.rank]
            partials.append(torch.zeros(rows, dtype=torch.float64))
            continue
        local = local_tensor(grad).detach().to("cpu", torch.float64)
        # flatten(1), not reshape(rows, -1): a rank whose shard of a parameter is empty (dim 0 smaller
        # than its ceil-chunked share, e.g. 4 experts over 3 ranks) has 0 rows, which reshape refuses.
        local = local.flatten(1) if local.dim() > 1 else local.reshape(-1, 1)
        partials.append((local * local).sum(dim=1))
    mine = torch.cat(partials) if partials else torch.zeros(0, dtype=torch.float64)
    if not ctx.distributed:
        return mine.sum().sqrt()
    per_rank = [
        [_row_chunks(p.shape[0] if p.dim() else 1, ctx.world_size)[r] for p in params] for r in range(ctx.world_size)
    ]
    longest = max(sum(counts) for counts in per_rank)
    padded = torch.zeros(longest, dtype=torch.float64)
    padded[: mine.numel()] = mine
    gathered = [torch.zeros(longest, dtype=torch.float64) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, padded)  # the training's group: this runs between its collectives
    pieces = []
    offsets = [0] * ctx.world_size
    for i in range(len(params)):
        for r in range(ctx.world_size):
            n = per_rank[r][i]
            pieces.append(gathered[r][offsets[r] : offsets[r] + n])
            offsets[r] += n
    return torch.cat(pieces).sum().sqrt()


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float, ctx: RankContext) -> float:
    """torch's clip_grad_norm_ rule (scale by max_norm / (norm + 1e-6) when above) with the canonical
    norm; returns the norm before clipping."""
    total = gradient_norm(params, ctx)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0).to(torch.float32)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coefficient.to(p.grad.device))
    return float(total)


def gather_owned(
    named: list[tuple[str, torch.Tensor]], owner_of: dict[str, int], ctx: RankContext
) -> dict[str, torch.Tensor]:
    """The full tensors of the parameters this rank owns for publishing, from the live (sharded) model,
    over the training's process group. See `gather_owned_shards`."""
    return gather_owned_shards(
        {n: local_tensor(t).detach() for n, t in named},
        {n: tuple(t.shape) for n, t in named},
        {n for n, t in named if is_sharded(t)},
        owner_of,
        ctx,
        group=None,
        device=ctx.device,
    )


def local_shards(named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """CPU copies of this rank's shard of every tensor (a buffer whole): what a version's capture keeps, so
    the gather to each owner can run later, beside the next update, from these copies."""
    return {n: local_tensor(t).detach().to("cpu", copy=True) for n, t in named}


def gather_owned_shards(
    local: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    sharded: set[str],
    owner_of: dict[str, int],
    ctx: RankContext,
    *,
    group=None,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """The full tensors of the parameters this rank owns for publishing, on CPU, fp32 as trained.

    `local`: this rank's dim-0 shard of every sharded tensor (whole ones for the rest), `shapes` their
    global shapes. Each rank sends its shard of every parameter to that parameter's owner only (one
    gather per owning rank, all of its parameters in one flat buffer): a rank receives the parameters
    it owns and nothing else, so no rank ever holds the whole model."""
    if not ctx.distributed:
        return {name: t.to("cpu", copy=True) for name, t in local.items() if owner_of.get(name, 0) == 0}
    device = device or torch.device("cpu")
    names = [n for n in local if n in owner_of]
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if owner_of[name] == ctx.rank and name not in sharded:
            out[name] = local[name].to("cpu", copy=True)  # a buffer: every rank holds all of it
    for owner in range(ctx.world_size):
        mine = [n for n in names if owner_of[n] == owner and n in sharded]
        if not mine:
            continue
        # Every rank's piece padded to the ceil-sized chunk, so the buffers have one size.
        rows_of = [shapes[n][0] if shapes[n] else 1 for n in mine]
        row_numel = [math.prod(shapes[n][1:]) if shapes[n] else 1 for n in mine]
        chunk_rows = [-(-rows // ctx.world_size) for rows in rows_of]
        sizes = [rows * numel for rows, numel in zip(chunk_rows, row_numel, strict=True)]
        buffer = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        offset = 0
        for name, size in zip(mine, sizes, strict=True):
            piece = local[name].reshape(-1).to(device=device, dtype=torch.float32)
            buffer[offset : offset + piece.numel()] = piece
            offset += size
        gathered = [torch.empty_like(buffer) for _ in range(ctx.world_size)] if ctx.rank == owner else None
        dist.gather(buffer, gathered, dst=owner, group=group)
        if ctx.rank != owner:
            continue
        assert gathered is not None
        offset = 0
        for name, rows, per_row, size in zip(mine, rows_of, row_numel, sizes, strict=True):
            counts = _row_chunks(rows, ctx.world_size)
            parts = [gathered[r][offset : offset + counts[r] * per_row] for r in range(ctx.world_size)]
            out[name] = torch.cat(parts).reshape(shapes[name]).to("cpu", copy=True)
            offset += size
    return out
