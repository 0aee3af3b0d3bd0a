"""Event contracts of sprawl: msgspec Structs are the source of truth."""

from schemas.codec import EventDecodeError, decode_event, encode_event, known_event_types
from schemas.envelope import Event
from schemas.events import (
    BlobPointer,
    ClaimCheck,
    DeadLetter,
    IslandHeartbeat,
    IslandIdentity,
    PolicyVersion,
    PromptGroup,
    Reward,
    SamplingParams,
    SkipPatch,
    TensorDigest,
    TrainerMetrics,
    Trajectory,
    VersionConstraint,
    VersionSpan,
    ViewVersion,
)

__all__ = [
    "BlobPointer",
    "ClaimCheck",
    "DeadLetter",
    "Event",
    "EventDecodeError",
    "IslandHeartbeat",
    "IslandIdentity",
    "PolicyVersion",
    "PromptGroup",
    "Reward",
    "SamplingParams",
    "SkipPatch",
    "TensorDigest",
    "TrainerMetrics",
    "Trajectory",
    "VersionConstraint",
    "VersionSpan",
    "ViewVersion",
    "decode_event",
    "encode_event",
    "known_event_types",
]
