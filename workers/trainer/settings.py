"""The trainer's settings: the update, the corrected loss, and which views it publishes.

No torch here: `sprawl trainer` validates these before it loads a model.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from pipeline.config import ChainSettings, Section, SprawlSettings
from pipeline.off_policy.settings import LossSection

__all__ = ["DriftSection", "LossSection", "TrainerSection", "TrainerSettings"]


class DriftSection(Section):
    """The per-island drift guard (`drift_guard.py`): an island whose sampler-trainer KL over the window
    exceeds the fleet's robust baseline by `factor` is flagged (and, with `quarantine`, left out of the
    loss until it recovers).

    The defaults are set from measurements on the demo task (tiny Qwen3-MoE, temperature 1, top-p 0.95;
    `tests/test_drift_guard.py` and the report of issue 18): healthy islands' windowed k3 KL is about
    bf16 2e-4..1e-3, fp8_e4m3 the same order, mxfp4 up to ~10x bf16, while an island that dequantizes
    its weights wrongly is at 1e-1 and more. Any factor between ~20 and ~100 separates the two; 25 sits
    with room on both sides."""

    enabled: bool = True
    """Measure and judge islands. Cheap (per-island sums of metrics the update computes anyway)."""
    window: int = Field(4, ge=1)
    """Updates an island's KL is pooled over (token-weighted). Short enough that a broken island is
    flagged within a few updates, long enough that one unlucky batch of an island with few tokens in it
    is not a verdict."""
    factor: float = Field(25.0, gt=1)
    """Flag an island whose windowed KL exceeds factor x the fleet's baseline. mxfp4 islands are ~10x
    a bf16 island's KL by design (4-bit weights), a broken dequantization is >100x: 25 keeps the first
    and catches the second."""
    recover_factor: float = Field(10.0, gt=0)
    """A flagged island recovers when its windowed KL falls below recover_factor x baseline (below
    `factor`: hysteresis, so an island near the line does not flip every update)."""
    floor_kl_k3: float = Field(2e-3, gt=0)
    """The baseline never falls below this: in a fleet where every island is ~0 (same numerics as the
    trainer), noise of 1e-5 against a median of 1e-6 is not a drift. Also the whole baseline when fewer
    than `min_islands` islands can be judged; then factor x floor (5e-2 by default) is an absolute bound
    that a healthy mxfp4 island stays under and a broken one does not."""
    min_islands: int = Field(3, ge=1)
    """Islands with enough tokens needed for the median to be the baseline. With two, the median is
    their mean, which a broken island drags up to half its own KL: it could never exceed 2x it. With
    fewer than this the baseline is `floor_kl_k3` alone."""
    min_tokens: int = Field(64, ge=1)
    """Tokens an island needs in its window to be judged (and to count in the baseline); below it its
    verdict stands as it was."""
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
    lease_ttl_s: float = Field(150.0, ge=4)
    """A lease not renewed for this long may be taken over by another trainer (the same `trainer_id`
    takes it back at once). Renewed every quarter of it; a trainer that cannot renew stops itself a
    quarter before expiry, so it rides out a log outage of at least half of it (75 s by default)."""
    loss: LossSection = LossSection()
    """The corrected surrogate."""
    drift: DriftSection = DriftSection()
    """The per-island drift guard."""


class TrainerSettings(SprawlSettings):
    trainer: TrainerSection = TrainerSection()
    """The update."""
    chain: ChainSettings = ChainSettings()
    """Which views are published and how."""
