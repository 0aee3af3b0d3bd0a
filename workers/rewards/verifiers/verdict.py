"""What every verifier is and returns: the contract the reward worker routes trajectories through."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from schemas import PromptGroup, Trajectory

if TYPE_CHECKING:
    from pipeline.sandbox import Sandbox


@dataclass
class Verdict:
    value: float
    error_class: str | None = None
    format_error: bool = False
    sandbox_id: str | None = None
    components: dict[str, float] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)


class Verifier(Protocol):
    name: ClassVar[str]
    """Its key in `VERIFIERS` and the `verifier` field of its rewards."""
    version: ClassVar[str]
    """Bumped when its judgement changes, so the audit can tell rewards of two versions apart."""
    needs_sandbox: ClassVar[bool]
    """It executes model output: the worker opens a sandbox (and requires its backend) only for these."""

    async def verify(self, trajectory: Trajectory, group: PromptGroup, sandbox: Sandbox | None) -> Verdict:
        """`sandbox` is None unless `needs_sandbox`."""
        ...
