"""The event contracts: what crosses the boundary between trainer, samplers and workers.

These Structs are the source of truth; `schemas/json/` holds their exported
JSON Schema for clients in other languages. Changes are additive (new fields
with defaults); a breaking change gets a new `.vN` type and an upcaster in
`schemas.upcasters`.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from schemas.envelope import Event


class Component(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """Base for nested value objects (no envelope)."""


# ---------------------------------------------------------------- policy versions


class BlobPointer(Component, kw_only=True):
    """One immutable object in the blob store, with what it must hash to."""

    uri: str
    sha256: str
    bytes: int
    name: str = ""
    """File name inside a checkpoint directory (keyframes), or the keyframe shard a patch covers."""


class TensorDigest(Component, kw_only=True, array_like=True):
    """One served tensor of a version: what its bits must hash to. Encoded as a JSON array (compact)."""

    name: str
    dtype: str
    shape: list[int]
    xxh3: str
    """xxh3-128 of the tensor's raw bytes."""
    changed: int
    """Elements whose bits differ from the base version (all of them for a keyframe)."""


class SkipPatch(Component, kw_only=True):
    """A patch that jumps from an older version straight to this one (for laggards)."""

    base_version: int
    blobs: list[BlobPointer]
    bytes: int
    changed_elements: int


class ViewVersion(Component, kw_only=True):
    """One served view (bf16, fp8_e4m3, ...) of a policy version, as stored in S3."""

    view: str
    """View name from the view registry, e.g. `bf16` or `fp8_e4m3`."""
    kind: Literal["keyframe", "patch"]
    base_version: int | None
    """For a patch: the version it applies to. None for a keyframe."""
    blobs: list[BlobPointer]
    """Keyframe: shards, index, config and extra files. Patch: one patch per keyframe shard."""
    tensors: list[TensorDigest]
    root_hash: str
    """xxh3-128 over (name, dtype, shape, xxh3) of every tensor: one value that names these exact bits."""
    bytes: int
    """Total bytes a sampler downloads to apply this entry."""
    changed_elements: int
    total_elements: int
    skip_patches: list[SkipPatch] = []


class PolicyVersion(Event, kw_only=True, tag="policy_version.v1"):
    """The trainer appended version N of the policy. Create-only, fenced."""

    version: int
    parent_version: int | None
    trainer_step: int
    views: list[ViewVersion]
    consumed_trajectories: int = 0
    """How many trajectories trained into this version."""
    lineage_uri: str | None = None
    """S3 URI of the list of trajectory ids consumed (kept out of the event: it can be large)."""

    def business_key(self) -> str:
        # The event id is part of the key: a retry of this very event dedups, while another
        # trainer's (or a restarted trainer's) v<N> must hit the create-only fence instead.
        return f"policy.v{self.version}.{self.event_id}"


# ---------------------------------------------------------------- prompts


class SamplingParams(Component, kw_only=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    logprobs_top_k: int = 0
    """How many top (id, logprob) pairs per generated token the sampler returns (score centering)."""
    seed: int | None = None


class VersionConstraint(Component, kw_only=True):
    """Which policy versions a request accepts. All None = any version."""

    min_version: int | None = None
    exact_version: int | None = None
    max_staleness: int | None = None


class PromptGroup(Event, kw_only=True, tag="prompt_group.v1"):
    """A prompt to be sampled n times (one GRPO group)."""

    group_id: str
    task: str
    """Routes the group's trajectories to a verifier."""
    prompt: str
    prompt_token_ids: list[int]
    n_samples: int
    sampling: SamplingParams = SamplingParams()
    accepts: VersionConstraint = VersionConstraint()
    answer: str | None = None
    """Reference answer for verifiers that need one; never shown to the sampler's model."""
    metadata: dict[str, str] = {}

    def business_key(self) -> str:
        return f"prompt.{self.group_id}"


# ---------------------------------------------------------------- trajectories


class VersionSpan(Component, kw_only=True):
    """Output tokens [start, end) were generated with policy `version`."""

    version: int
    start: int
    end: int


class IslandIdentity(Component, kw_only=True):
    """Who generated: enough to group samplers by numerics in audits."""

    island_id: str
    accelerator: str
    """e.g. `cpu`, `H100-80GB`, `MI300X`."""
    view: str
    """The served view (precision), e.g. `bf16`, `fp8_e4m3`."""
    engine: str
    """`torch`, `vllm`, `sglang`."""
    engine_version: str = ""
    kernels: dict[str, str] = {}
    region: str = ""
    group: str = ""
    """The sampler group (e.g. `fp8-h100`): metrics like KL are reported per group."""


class Trajectory(Event, kw_only=True, tag="trajectory.v1"):
    """One sampled completion with everything the trainer needs to correct for being off-policy."""

    trajectory_id: str
    group_id: str
    sample_index: int
    task: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logprobs: list[float]
    """Sampler logprob of each output token under the processed (temperature, top-p) distribution."""
    raw_logprobs: list[float] = []
    """The same tokens under the engine's unprocessed distribution (temperature 1, no truncation)."""
    finish_reason: Literal["stop", "length", "abort"]
    version_spans: list[VersionSpan]
    island: IslandIdentity
    sampling: SamplingParams = SamplingParams()
    top_logprob_ids: list[list[int]] = []
    """Per output token: ids of the top-k tokens of the sampling distribution."""
    top_logprobs: list[list[float]] = []
    """Per output token: their logprobs, unrenormalized."""
    top_p_kept_ids: list[list[int]] | None = None
    """Per output token: the kept set the token was sampled from (top-p mask replay)."""
    routed_experts: list[list[list[int]]] | None = None
    """Per token, per MoE layer: the routed expert ids (routing replay)."""
    loss_mask: list[int] | None = None
    """Per output token, 1 if the trainer learns from it (multi-turn: 0 for tool output)."""
    text: str = ""
    group_size: int = 0
    """n, the samples in this trajectory's prompt group (0: unknown, the trainer's setting applies)."""

    def business_key(self) -> str:
        return f"traj.{self.trajectory_id}"


# ---------------------------------------------------------------- rewards


class Reward(Event, kw_only=True, tag="reward.v1"):
    trajectory_id: str
    group_id: str
    value: float
    verifier: str
    verifier_version: str
    duration_s: float
    components: dict[str, float] = {}
    sandbox_id: str | None = None
    error_class: str | None = None
    """None if the verifier ran to completion; otherwise e.g. `timeout`, `memory`, `crash`."""
    format_error: bool = False
    details: dict[str, str] = {}
    """Free-form verifier findings, e.g. the first failing hidden test."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # JSON has no Inf/NaN (they would encode as null and fail to decode): refuse at the producer.
        if not math.isfinite(self.value) or not all(math.isfinite(v) for v in self.components.values()):
            raise ValueError(f"reward for {self.trajectory_id} is not finite: {self.value}, {self.components}")

    def business_key(self) -> str:
        return f"reward.{self.trajectory_id}"


# ---------------------------------------------------------------- health and metrics


class IslandHeartbeat(Event, kw_only=True, tag="island_heartbeat.v2"):
    """An island is alive, at a version, with some load. v2 split v1's free-text `accelerator`."""

    schema_version: int = 2
    island: IslandIdentity
    current_version: int | None
    state: Literal["starting", "serving", "catching_up", "draining"] = "serving"
    inflight_requests: int = 0
    queue_pending: int | None = None
    """Prompt groups waiting in the shared queue (None when not known)."""
    cached_versions: list[int] = []
    """Versions materialized on the island's disk (a laggard catches up from these)."""
    prompt_groups_done: int = 0
    tokens_generated: int = 0
    tokens_per_s: float = 0.0
    """Output tokens per second since the previous heartbeat."""


class TrainerMetrics(Event, kw_only=True, tag="trainer_metrics.v1"):
    step: int
    version: int
    metrics: dict[str, float]
    per_group: dict[str, dict[str, float]] = {}
    """Metrics per sampler group (island view/accelerator), e.g. KL by precision."""


class TrainerCheckpoint(Event, kw_only=True, tag="trainer_checkpoint.v1"):
    """The trainer's state after publishing `version` is durable at `uri` (blob first, event second)."""

    version: int
    step: int
    uri: str
    sha256: str
    bytes: int
    trajectory_position: int
    """Replay trajectories from this stream sequence to rebuild what was pending."""
    reward_position: int

    def business_key(self) -> str:
        return f"ckpt.v{self.version}.{self.event_id}"


class GroupDropped(Event, kw_only=True, tag="group_dropped.v1"):
    """A prompt group the trainer gave up on, and why."""

    group_id: str
    reason: str
    trajectory_ids: list[str]
    waited_s: float

    def business_key(self) -> str:
        return f"dropped.{self.group_id}"


class TrainerLease(Event, kw_only=True, tag="trainer_lease.v1"):
    """The trainer holding a run says it is alive; a second trainer refuses to start while it is fresh."""

    holder: str
    expires_at: float
    """Unix time after which another trainer may take over."""


# ---------------------------------------------------------------- plumbing


class DeadLetter(Event, kw_only=True, tag="dead_letter.v1"):
    """A message a consumer refused for good, with why, and the original bytes."""

    reason: str
    error_class: str
    stream: str
    consumer: str
    original_subject: str
    original_seq: int
    num_delivered: int
    payload: bytes
    headers: dict[str, str] = {}

    def business_key(self) -> str:
        return f"dlq.{self.stream}.{self.original_seq}"


class ClaimCheck(Event, kw_only=True, tag="claim_check.v1"):
    """Stands in for an event too large for the log: the encoded event lives in S3."""

    event_type: str
    uri: str
    sha256: str
    bytes: int


CURRENT_EVENTS: tuple[type[Event], ...] = (
    PolicyVersion,
    PromptGroup,
    Trajectory,
    Reward,
    IslandHeartbeat,
    TrainerMetrics,
    DeadLetter,
    ClaimCheck,
    TrainerCheckpoint,
    GroupDropped,
    TrainerLease,
)
