"""`exact`: the demo task's check. The answer is the last line, compared verbatim with the reference."""

from __future__ import annotations

from schemas import PromptGroup, Trajectory
from workers.rewards.verifiers.answers import answer_format_ok, final_answer
from workers.rewards.verifiers.verdict import Verdict


class ExactAnswer:
    name, version, needs_sandbox = "exact", "1", False

    async def verify(self, trajectory: Trajectory, group: PromptGroup, sandbox=None) -> Verdict:
        ok_format = answer_format_ok(trajectory.text, group)
        correct = group.answer is not None and final_answer(trajectory.text) == group.answer.strip()
        return Verdict(
            value=1.0 if correct else 0.0,
            format_error=not ok_format,
            error_class=None if ok_format else "format",
            components={"correct": float(correct)},
        )
