"""The trainer's settings: the update, the corrected loss, and which views it publishes.

No torch here: `sprawl trainer` validates these before it loads a model.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from pipeline.config import ChainSettings, Section, SprawlSettings
from pipeline.off_policy.settings import LossSection

__all__ = ["LossSection", "TrainerSection", "TrainerSettings"]


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
    lease_ttl_s: float = Field(150.0, ge=4)
    """A lease not renewed for this long may be taken over by another trainer (the same `trainer_id`
    takes it back at once). Renewed every quarter of it; a trainer that cannot renew stops itself a
    quarter before expiry, so it rides out a log outage of at least half of it (75 s by default)."""
    loss: LossSection = LossSection()
    """The corrected surrogate."""


class TrainerSettings(SprawlSettings):
    trainer: TrainerSection = TrainerSection()
    """The update."""
    chain: ChainSettings = ChainSettings()
    """Which views are published and how."""
