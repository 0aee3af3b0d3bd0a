"""The trainer's settings: the update, the corrected loss, and which views it publishes.

No torch here: `sprawl trainer` validates these before it loads a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline.config import ChainSettings, Section, SprawlSettings
from pipeline.off_policy.settings import LossSection

__all__ = ["DriftSection", "LossSection", "TrainerSection", "TrainerSettings"]


class DriftSection(Section):
    """The per-island drift guard (`drift_guard.py`): an island whose sampler-trainer KL over the window
    exceeds the fleet's robust baseline by `factor` is flagged (and, with `quarantine`, left out of the
    loss until it recovers).

    The defaults come from measurements on the demo task (tiny Qwen3-MoE warmed up 550 steps as `sprawl
    up` does, temperature 1, top-p 0.95, 16 trajectories per island per update, 30 updates of RL, two
    seeds; figures in issue 18's drift-guard report). Windowed k3 KL (the median over the window's
    updates): healthy bf16 5e-5..2.6e-4, fp8_e4m3 9e-5..7.4e-4, mxfp4 1.7e-4..1.8e-2 (4-bit weights: up
    to ~40x fp8, and growing as RL sharpens the policy); wrong dequantization: fp8 read as e4m3fnuz
    (weights halved) 0.16..0.56, mxfp4 with swapped nibbles 2.4..6. The threshold, factor x baseline, is
    at least 50 x 1e-3 = 5e-2: ~3x above the worst healthy mxfp4 window, ~3x below the mildest broken one."""

    enabled: bool = True
    """Measure and judge islands. Cheap: per-island sums of quantities the update computes anyway."""
    window: int = Field(8, ge=1)
    """Updates an island's KL is judged over (the token-weighted median of their KLs). One rare token
    makes a single update's KL spike 10-40x; the median of 8 updates ignores up to 3 such spikes. A
    verdict does not wait for the window to fill (`min_tokens` decides), so the window costs no
    detection latency; it sets how long a repaired island takes to recover (its bad updates must age
    out: about half the window)."""
    factor: float = Field(50.0, gt=1)
    """Flag an island whose windowed KL exceeds factor x the fleet's baseline. A healthy mxfp4 island's
    KL is 10-40x a bf16 or fp8 island's (measured), and in a fleet of bf16 + fp8 + mxfp4 the median is
    the fp8 island; a broken dequantization is 500x and more: 50 keeps the first and catches the second."""
    recover_factor: float = Field(10.0, gt=0)
    """A flagged island recovers when its windowed KL falls below recover_factor x baseline; below
    `factor`, so an island near the line does not flip every update (hysteresis)."""
    floor_kl_k3: float = Field(1e-3, gt=0)
    """The baseline never falls below this: in a fleet whose KL is ~0 (every island computes like the
    trainer) a rare-token spike against a median of 1e-5 is not a drift. It is also the whole baseline
    when fewer than `min_islands` islands can be judged, where factor x floor (5e-2) is an absolute
    bound: a healthy island of any view stays ~3x under it on the demo, a broken one ~3x over. On a
    model whose healthy KL is higher (a larger one, a sampler-trainer temperature mismatch), set it
    from a healthy run's per-island metrics."""
    ceiling_kl_k3: float | None = Field(None, gt=0)
    """An absolute line: an island whose windowed KL exceeds it is flagged whatever the fleet's median
    (and recovers below recover_factor / factor of it). The median is robust to a minority of broken
    islands only: with 2 of 3 broken, each broken one is judged against the median of a broken and a
    healthy island (half a broken KL) and the healthy one against two broken ones, so nothing is
    flagged. None (the default): no such line, as before; on the demo, 5e-2 (factor x floor) sits ~3x
    above the worst healthy mxfp4 window and ~3x below the mildest broken one. Set it from a healthy
    run's per-island metrics where the fleet's KL is higher (a larger model, a temperature mismatch)."""
    min_islands: int = Field(3, ge=1)
    """Judged islands needed for their median to be the baseline. Of two, the median is their mean,
    which a broken island drags up to half its own KL: it could never exceed 2x that. With fewer than
    this the baseline is `floor_kl_k3` alone."""
    min_tokens: int = Field(128, ge=1)
    """Tokens an island needs in its window to be judged and to count in the baseline (below it its
    verdict stands): with fewer, one rare-token spike would be the whole verdict. About 3 updates of
    an island that samples 16 trajectories of the demo task (~3.5 tokens each) per update."""
    quarantine: bool = False
    """Leave a flagged island's trajectories out of the loss until it recovers (they are still forwarded,
    so its KL stays measured). Off by default: flagging is a diagnosis, quarantine changes training."""

    @model_validator(mode="after")
    def _hysteresis(self) -> DriftSection:
        if self.recover_factor > self.factor:
            raise ValueError(f"recover_factor ({self.recover_factor}) must not exceed factor ({self.factor})")
        return self


class TrainerSection(Section):
    model_dir: Path = Path(".sprawl/model")
    """HF checkpoint of the initial policy (the warm-up's output)."""
    trainer_id: str = ""
    """Stable identity for the run's lease (default: the host name); a restart with the same id takes over."""
    groups_per_batch: int = Field(4, ge=1)
    """B: prompt groups per update."""
    group_size: int = Field(8, ge=1)
    """n: samples per group, when trajectories do not say."""
    max_group_wait_s: float = Field(300.0, gt=0)
    """Incomplete groups older than this are dropped, with a reason in the log."""
    learning_rate: float = Field(1e-5, gt=0)
    """Adam learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping."""
    normalize_std: bool = True
    """GRPO: divide group-centered rewards by the group std."""
    routing_replay: bool = False
    """Force the experts the sampler routed to (MoE)."""
    train_temperature: float | None = Field(None, gt=0)
    """The temperature the trainer computes its logprobs at. None: each trajectory's own sampling
    temperature (trainer and sampler agree). A different value is a sampler-trainer mismatch on purpose,
    as a fleet configured apart from its trainer has; `sprawl experiment stability` uses it as stress."""
    max_staleness: int | None = Field(None, ge=0)
    """Tokens staler than this leave the loss; None: unbounded."""
    checkpoint_every: int = Field(10, ge=1)
    """Checkpoint the full trainer state every N versions."""
    publish_depth: int = Field(2, ge=1, le=16)
    """Versions captured and not yet appended: the next update runs while they are published in the
    background, in order. When all are in flight the update waits (its wait is the `publish_wait_s`
    metric). Each costs one copy of the master weights; 2 lets a keyframe's longer publish overlap
    two updates."""
    max_versions: int | None = Field(None, ge=0)
    """Stop after publishing this version (None: run until stopped)."""
    seed: int = Field(0, ge=0)
    """Seed of every RNG (runs are deterministic on CPU)."""
    threads: int = Field(1, ge=1)
    """torch threads; fixed so that results are bitwise reproducible."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the update runs. `cuda` needs a CUDA build of torch; each rank takes the GPU of its local
    rank. Views are always computed from CPU copies, so what is published does not depend on it."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """`bf16`: the forward and backward run under bf16 autocast; master weights, gradients and the
    optimizer state stay fp32 (what is published is cast from the fp32 masters, as with `fp32`)."""
    ranks: int = Field(1, ge=1)
    """Processes to train with (FSDP2 over torch.distributed): `sprawl trainer` launches them on this
    host with torchrun. Across hosts, run `torchrun ... -m workers.cli trainer` yourself (README)."""
    micro_batches: int | None = Field(None, ge=1)
    """Slices each update's batch is cut into (whole groups each); every rank computes its share one
    after another, accumulating gradients. None: one per rank. A run with one rank and 2 slices computes
    the same bits as two ranks with one slice each (CPU): the sum of two gradients is order-free (of
    three or more it is not: the collective's order then decides the last bits)."""
    max_restarts: int = Field(3, ge=0)
    """With several ranks: times torchrun restarts all of them after one fails or is killed (each
    restart recovers from the newest checkpoint and the lineage, as a single trainer does)."""
    collective_timeout_s: float = Field(600.0, gt=0)
    """A rank waiting this long in a collective for another rank fails (and the job restarts); a killed
    rank's peers usually fail at once, on the closed connection."""
    lease_ttl_s: float = Field(150.0, ge=4)
    """A lease not renewed for this long may be taken over by another trainer (the same `trainer_id`
    takes it back at once). Renewed every quarter of it; a trainer that cannot renew stops itself a
    quarter before expiry, so it rides out a log outage of at least half of it (75 s by default)."""
    loss: LossSection = LossSection()
    """The corrected surrogate."""
    drift: DriftSection = DriftSection()
    """The per-island drift guard."""

    @model_validator(mode="after")
    def _slices_fit(self) -> TrainerSection:
        if self.micro_batches is not None:
            if self.micro_batches % self.ranks:
                raise ValueError(f"micro_batches ({self.micro_batches}) must be a multiple of ranks ({self.ranks})")
            if self.micro_batches > self.groups_per_batch:
                raise ValueError(
                    f"micro_batches ({self.micro_batches}) exceeds groups_per_batch ({self.groups_per_batch}):"
                    " a slice holds whole groups"
                )
        elif self.ranks > self.groups_per_batch:
            raise ValueError(
                f"ranks ({self.ranks}) exceeds groups_per_batch ({self.groups_per_batch}): a rank needs a group"
            )
        return self


class TrainerSettings(SprawlSettings):
    trainer: TrainerSection = TrainerSection()
    """The update."""
    chain: ChainSettings = ChainSettings()
    """Which views are published and how."""
