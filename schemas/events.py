"""The event contracts: what crosses the boundary between trainer, samplers and workers.

These Structs are the source of truth; `schemas/json/` holds their exported
JSON Schema for clients in other languages. Changes are additive (new fields
with defaults); a breaking change gets a new `.vN` type and an upcaster in
`schemas.upcasters`.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from schemas.envelope import EVENT_TYPE_PATTERN, Event, NonEmpty, Token, whole_string

Count = Annotated[int, msgspec.Meta(ge=0)]
"""Bytes, elements, tokens, steps, stream positions: never negative."""
VersionNumber = Annotated[int, msgspec.Meta(ge=0)]
"""A policy version; the first keyframe is version 0."""
TokenId = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]
Sha256Hex = Annotated[str, msgspec.Meta(pattern=whole_string("[0-9a-f]{64}"), description="Lowercase hex SHA-256.")]
Xxh3Hex = Annotated[str, msgspec.Meta(pattern=whole_string("[0-9a-f]{32}"), description="Lowercase hex xxh3-128.")]
MaskBit = Annotated[int, msgspec.Meta(ge=0, le=1)]
Base64Bytes = Annotated[
    bytes,
    # `contentEncoding` only annotates in Draft 2020-12; the pattern makes a validator refuse what msgspec's
    # base64 decoder refuses (standard alphabet, padded).
    msgspec.Meta(
        extra_json_schema={"pattern": whole_string("(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")}
    ),
]


class Component(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """Base for nested value objects (no envelope)."""


# ---------------------------------------------------------------- policy versions


class BlobPointer(Component, kw_only=True):
    """One immutable object in the blob store, with what it must hash to."""

    uri: NonEmpty
    sha256: Sha256Hex
    bytes: Count
    name: str = ""
    """File name inside a checkpoint directory (keyframes), or the keyframe shard a patch covers."""


class TensorDigest(Component, kw_only=True, array_like=True):
    """One served tensor of a version: what its bits must hash to. Encoded as a JSON array (compact)."""

    name: NonEmpty
    dtype: NonEmpty
    shape: list[Count]
    xxh3: Xxh3Hex
    """xxh3-128 of the tensor's raw bytes."""
    changed: Count
    """Elements whose bits differ from the base version (all of them for a keyframe)."""


class SkipPatch(Component, kw_only=True):
    """A patch that jumps from an older version straight to this one (for laggards)."""

    base_version: VersionNumber
    blobs: list[BlobPointer]
    bytes: Count
    changed_elements: Count


class ViewVersion(Component, kw_only=True):
    """One served view (bf16, fp8_e4m3, ...) of a policy version, as stored in S3."""

    view: NonEmpty
    """View name from the view registry, e.g. `bf16` or `fp8_e4m3`."""
    kind: Literal["keyframe", "patch"]
    base_version: VersionNumber | None
    """For a patch: the version it applies to. None for a keyframe."""
    blobs: list[BlobPointer]
    """Keyframe: shards, index, config and extra files. Patch: one patch per keyframe shard."""
    tensors: list[TensorDigest]
    root_hash: Xxh3Hex
    """xxh3-128 over (name, dtype, shape, xxh3) of every tensor: one value that names these exact bits."""
    bytes: Count
    """Total bytes a sampler downloads to apply this entry."""
    changed_elements: Count
    total_elements: Count
    skip_patches: list[SkipPatch] = []


KeyId = Annotated[
    str,
    msgspec.Meta(pattern=whole_string("[0-9a-f]{16}"), description="First 16 hex of the SHA-256 of a raw public key."),
]


class VersionSignature(Component, kw_only=True):
    """The trainer's signature over a version's manifest (`schemas/version_manifest.py` names the exact
    bytes signed)."""

    algorithm: Literal["ed25519"] = "ed25519"
    key_id: KeyId
    """Which key signed: an island pinned to another key says so instead of "bad signature"."""
    signature: Base64Bytes
    """The 64-byte Ed25519 signature."""


class PolicyVersion(Event, kw_only=True, tag="policy_version.v1"):
    """The trainer appended version N of the policy. Create-only, fenced."""

    version: VersionNumber
    parent_version: VersionNumber | None
    trainer_step: Count
    views: list[ViewVersion]
    consumed_trajectories: Count = 0
    """How many trajectories trained into this version."""
    lineage_uri: str | None = None
    """S3 URI of the list of trajectory ids consumed (kept out of the event: it can be large)."""
    lineage_sha256: Sha256Hex | None = None
    """What the lineage blob hashes to (signed with the manifest; None in events written before it)."""
    signature: VersionSignature | None = None
    """The trainer's signature over the version's manifest; None: unsigned (islands pinned to a key refuse it)."""

    def business_key(self) -> str:
        # The event id is part of the key: a retry of this very event dedups, while another
        # trainer's (or a restarted trainer's) v<N> must hit the create-only fence instead.
        return f"policy.v{self.version}.{self.event_id}"


# ---------------------------------------------------------------- prompts


class SamplingParams(Component, kw_only=True):
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """0 is greedy."""
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """-1 or 0: no top-k truncation."""
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 256
    logprobs_top_k: Count = 0
    """How many top (id, logprob) pairs per generated token the sampler returns (score centering)."""
    seed: int | None = None


class VersionConstraint(Component, kw_only=True):
    """Which policy versions a request accepts. All None = any version."""

    min_version: VersionNumber | None = None
    exact_version: VersionNumber | None = None
    max_staleness: Count | None = None


class PromptGroup(Event, kw_only=True, tag="prompt_group.v1"):
    """A prompt to be sampled n times (one GRPO group)."""

    group_id: Token
    task: NonEmpty
    """Routes the group's trajectories to a verifier."""
    prompt: str
    prompt_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    n_samples: Annotated[int, msgspec.Meta(ge=1)]
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

    version: VersionNumber
    start: Count
    end: Count


class IslandIdentity(Component, kw_only=True):
    """Who generated: enough to group samplers by numerics in audits."""

    island_id: Token
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


def _per_output_token(unless: str) -> msgspec.Meta:
    # A rule between fields JSON Schema cannot state: the decoder enforces it (a trajectory that breaks it
    # would crash the trainer's whole batch, so it is dead-lettered at decode instead); the schema says it.
    return msgspec.Meta(description=f"{unless}one entry per output token (checked by the decoder).")


class Trajectory(Event, kw_only=True, tag="trajectory.v1"):
    """One sampled completion with everything the trainer needs to correct for being off-policy.

    Checked by the decoder beyond this schema: logprobs has one entry per output token; raw_logprobs,
    top_logprob_ids, top_logprobs, top_p_kept_ids and loss_mask are empty (or null) or have one entry per
    output token; top_logprob_ids and top_logprobs have the same shape.
    """

    trajectory_id: Token
    group_id: Token
    sample_index: Count
    task: NonEmpty
    prompt_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    output_token_ids: list[TokenId]
    logprobs: Annotated[list[float], _per_output_token("")]
    """Sampler logprob of each output token under the processed (temperature, top-p) distribution."""
    raw_logprobs: Annotated[list[float], _per_output_token("Empty, or ")] = []
    """The same tokens under the engine's unprocessed distribution (temperature 1, no truncation)."""
    finish_reason: Literal["stop", "length", "abort"]
    version_spans: list[VersionSpan]
    island: IslandIdentity
    sampling: SamplingParams = SamplingParams()
    top_logprob_ids: Annotated[list[list[TokenId]], _per_output_token("Empty, or ")] = []
    """Per output token: ids of the top-k tokens of the sampling distribution."""
    top_logprobs: Annotated[
        list[list[float]],
        msgspec.Meta(description="The shape of top_logprob_ids: its rows, each as long (checked by the decoder)."),
    ] = []
    """Per output token: their logprobs, unrenormalized."""
    top_p_kept_ids: Annotated[list[list[TokenId]] | None, _per_output_token("Null, empty, or ")] = None
    """Per output token: the kept set the token was sampled from (top-p mask replay)."""
    routed_experts: list[list[list[Count]]] | None = None
    """Per token, per MoE layer: the routed expert ids (routing replay)."""
    loss_mask: Annotated[list[MaskBit] | None, _per_output_token("Null, or ")] = None
    """Per output token, 1 if the trainer learns from it (multi-turn: 0 for tool output)."""
    text: str = ""
    group_size: Count = 0
    """n, the samples in this trajectory's prompt group (0: unknown, the trainer's setting applies)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        out = len(self.output_token_ids)
        lengths = {"logprobs": len(self.logprobs)}
        may_be_empty = {
            "raw_logprobs": self.raw_logprobs,
            "top_logprob_ids": self.top_logprob_ids,
            "top_logprobs": self.top_logprobs,
            "top_p_kept_ids": self.top_p_kept_ids,
        }
        lengths |= {name: len(values) for name, values in may_be_empty.items() if values}
        if self.loss_mask is not None:
            lengths["loss_mask"] = len(self.loss_mask)
        wrong = {name: n for name, n in lengths.items() if n != out}
        if wrong:
            raise ValueError(f"trajectory {self.trajectory_id}: {wrong} entries for {out} output tokens")
        if len(self.top_logprob_ids) != len(self.top_logprobs) or any(
            len(ids) != len(lps) for ids, lps in zip(self.top_logprob_ids, self.top_logprobs, strict=True)
        ):
            raise ValueError(f"trajectory {self.trajectory_id}: top_logprob_ids and top_logprobs differ in shape")

    def business_key(self) -> str:
        return f"traj.{self.trajectory_id}"


# ---------------------------------------------------------------- rewards


class Reward(Event, kw_only=True, tag="reward.v1"):
    """A verifier's verdict on one trajectory."""

    trajectory_id: Token
    group_id: Token
    value: float
    verifier: NonEmpty
    verifier_version: str
    duration_s: Seconds
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

    island: IslandIdentity
    current_version: VersionNumber | None
    state: Literal["starting", "serving", "catching_up", "draining"] = "serving"
    inflight_requests: Count = 0
    queue_pending: Count | None = None
    """Prompt groups waiting in the shared queue (None when not known)."""
    cached_versions: list[VersionNumber] = []
    """Versions materialized on the island's disk (a laggard catches up from these)."""
    prompt_groups_done: Count = 0
    tokens_generated: Count = 0
    tokens_per_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Output tokens per second since the previous heartbeat."""
    refused_versions: Count = 0
    """Versions (or their blobs) this island refused over its life: unsigned, signed by another key, or a
    blob whose bytes differ from the signed digest. Each is also a dead letter."""


class TrainerMetrics(Event, kw_only=True, tag="trainer_metrics.v1"):
    """What one trainer step measured."""

    step: Count
    version: VersionNumber
    metrics: dict[str, float]
    per_group: dict[str, dict[str, float]] = {}
    """Metrics per sampler group (island view/accelerator), e.g. KL by precision."""
    per_island: dict[str, dict[str, float]] = {}
    """Metrics per island id (its KL, ESS and tokens this update, and the drift guard's windowed KL and
    verdict), what the drift guard judges on."""


class IslandDrift(Event, kw_only=True, tag="island_drift.v1"):
    """The trainer's drift guard changed its verdict on an island: flagged (its sampler-trainer KL over
    the window exceeds the fleet's robust baseline by the configured factor) or recovered."""

    island_id: Token
    view: str = ""
    state: Literal["flagged", "recovered"]
    version: VersionNumber
    """The trainer version whose update made the verdict."""
    kl_k3: Annotated[float, msgspec.Meta(ge=0)]
    """The token-weighted median of the island's per-update k3 KL over the window (k3 is heavy-tailed:
    one rare token can spike a healthy update 40x)."""
    ess_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)]
    """The island's effective sample size ratio over the window."""
    baseline_kl_k3: Annotated[float, msgspec.Meta(ge=0)]
    """What it was compared with: the median of the other islands' KL, floored (the floor alone when
    fewer islands than the guard's `min_islands` are judged)."""
    factor: Annotated[float, msgspec.Meta(gt=0)]
    quarantined: bool = False
    """True: the island's trajectories leave the loss until it recovers."""

    def business_key(self) -> str:
        return f"drift.{self.island_id}.v{self.version}.{self.state}"


class StabilityResult(Event, kw_only=True, tag="stability_result.v1"):
    """One run of `sprawl experiment stability`: its cell, its seed, and what the collapse rule found."""

    experiment_id: Token
    cell_run_id: Token
    """The run this cell's seed trained in (its own metrics, versions and trajectories are archived there)."""
    fleet: Token
    correction: NonEmpty
    seed: Count
    updates: Count
    collapsed: bool
    updates_to_collapse: Count | None = None
    start_reward: float
    final_reward: float | None
    """Mean reward over the run's last updates; None when none of them had a reward."""
    kl_mean: float | None
    """Mean sampler-trainer KL (k3) over the run; None when no update had a token in the loss."""
    collapse_rule: NonEmpty
    stress: dict[str, float] = {}
    """The stress levels this run had (staleness, temperatures, top-p)."""
    series: dict[str, list[float | None]] = {}
    """Per-update curves of the run (reward_mean, kl_k3, ...), one value per update in version order
    (None: that update had no value, e.g. no KL when every token left the loss)."""

    def business_key(self) -> str:
        return f"stability.{self.experiment_id}.{self.fleet}.{self.correction}.{self.seed}"


class TrainerCheckpoint(Event, kw_only=True, tag="trainer_checkpoint.v1"):
    """The trainer's state after publishing `version` is durable at `uri` (blob first, event second)."""

    version: VersionNumber
    step: Count
    uri: NonEmpty
    sha256: Sha256Hex
    bytes: Count
    trajectory_position: Count
    """Replay trajectories from this stream sequence to rebuild what was pending."""
    reward_position: Count

    def business_key(self) -> str:
        return f"ckpt.v{self.version}.{self.event_id}"


class GroupDropped(Event, kw_only=True, tag="group_dropped.v1"):
    """A prompt group the trainer gave up on, and why."""

    group_id: Token
    reason: str
    trajectory_ids: list[Token]
    waited_s: Seconds

    def business_key(self) -> str:
        return f"dropped.{self.group_id}"


class TrainerLease(Event, kw_only=True, tag="trainer_lease.v1"):
    """The trainer holding a run says it is alive; a second trainer refuses to start while it is fresh."""

    holder: NonEmpty
    expires_at: float
    """Unix time after which another trainer may take over."""


# ---------------------------------------------------------------- plumbing


class DeadLetter(Event, kw_only=True, tag="dead_letter.v1"):
    """A message a consumer refused for good, with why, and the original bytes."""

    reason: str
    error_class: NonEmpty
    stream: NonEmpty
    consumer: NonEmpty
    original_subject: NonEmpty
    original_seq: Count
    num_delivered: Count
    payload: Base64Bytes
    """The refused bytes."""
    headers: dict[str, str] = {}

    def business_key(self) -> str:
        return f"dlq.{self.stream}.{self.original_seq}"


class ClaimCheck(Event, kw_only=True, tag="claim_check.v1"):
    """Stands in for an event too large for the log: the encoded event lives in S3."""

    event_type: Annotated[str, msgspec.Meta(pattern=EVENT_TYPE_PATTERN)]
    uri: NonEmpty
    sha256: Sha256Hex
    bytes: Count


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
    IslandDrift,
    StabilityResult,
)
