"""`format`: flags malformed answers without judging them (the collapse monitor counts these)."""

from __future__ import annotations

from schemas import PromptGroup, Trajectory
from workers.rewards.verifiers.answers import answer_format_ok
from workers.rewards.verifiers.verdict import Verdict


class FormatCheck:
    name, version, needs_sandbox = "format", "1", False

    async def verify(self, trajectory: Trajectory, group: PromptGroup, sandbox=None) -> Verdict:
        ok = answer_format_ok(trajectory.text, group)
        return Verdict(value=1.0 if ok else 0.0, format_error=not ok, error_class=None if ok else "format")
