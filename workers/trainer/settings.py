"""The trainer's settings: the update, the corrected loss, and which views it publishes."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import ChainSettings, Section, SprawlSettings
from pipeline.off_policy import LossConfig


class LossSection(Section):
    surrogate: str = "pg"
    """`pg` (policy gradient) or `ppo` (clipped)."""
    importance: str = "mis"
    """`none`, `tis` or `mis` importance weights between trainer and sampler."""
    importance_level: str = "token"
    """`token` or `sequence`."""
    geometric_rejection: bool = False
    """Drop sequences whose geometric-mean ratio leaves [geometric_low, geometric_high]."""
    score_centering: bool = True
    """Subtract the expected score under the sampling policy (top-k form)."""
    mask_replay: bool = True
    """Renormalize the trainer's distribution over the sampler's kept top-p set."""
    length_normalization: bool = False
    """Weigh sequences equally instead of tokens."""
    mis_low: float = 0.5
    """MIS lower bound on the token ratio."""
    mis_high: float = 5.0
    """MIS upper bound on the token ratio."""
    tis_cap: float = 2.0
    """TIS cap."""

    def config(self) -> LossConfig:
        return LossConfig(**self.model_dump())  # type: ignore[arg-type]


class TrainerSection(Section):
    model_dir: Path = Path(".sprawl/model")
    """HF checkpoint of the initial policy (the warm-up's output)."""
    trainer_id: str = ""
    """Stable identity for the run's lease (default: the host name); a restart with the same id takes over."""
    groups_per_batch: int = 4
    """B: prompt groups per update."""
    group_size: int = 8
    """n: samples per group, when trajectories do not say."""
    max_group_wait_s: float = 300.0
    """Incomplete groups older than this are dropped, with a reason in the log."""
    learning_rate: float = 1e-5
    """Adam learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    normalize_std: bool = True
    """GRPO: divide group-centered rewards by the group std."""
    routing_replay: bool = False
    """Force the experts the sampler routed to (MoE)."""
    max_staleness: int | None = None
    """Tokens staler than this leave the loss; None: unbounded."""
    checkpoint_every: int = 10
    """Checkpoint the full trainer state every N versions."""
    max_versions: int | None = None
    """Stop after publishing this version (None: run until stopped)."""
    seed: int = 0
    """Seed of every RNG (runs are deterministic on CPU)."""
    threads: int = 1
    """torch threads; fixed so that results are bitwise reproducible."""
    lease_ttl_s: float = 15.0
    """A lease not renewed for this long may be taken over."""
    loss: LossSection = LossSection()
    """The corrected surrogate."""


class TrainerSettings(SprawlSettings):
    trainer: TrainerSection = TrainerSection()
    """The update."""
    chain: ChainSettings = ChainSettings()
    """Which views are published and how."""
