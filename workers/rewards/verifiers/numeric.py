"""`number`: the last number in the completion, read as an integer, equals the reference answer.

For word problems whose completions may explain before they answer ("12 + 7 = 19, so 19 apples"):
the last ASCII number written is the answer, compared with the reference as canonical integer
digits (`1,024`, `1024.0` and `01024` all read as 1024; `19.5` is not an integer and scores 0).
A completion with no number is a format error, as the other verifiers count them.
"""

from __future__ import annotations

from schemas import PromptGroup, Trajectory
from workers.rewards.verifiers.answers import integer_value, last_number
from workers.rewards.verifiers.verdict import Verdict


class NumericAnswer:
    name, version, needs_sandbox = "number", "1", False

    async def verify(self, trajectory: Trajectory, group: PromptGroup, sandbox=None) -> Verdict:
        written = last_number(trajectory.text)
        reference = integer_value(group.answer.strip()) if group.answer is not None else None
        if reference is None:  # the task's fault, not the model's: no reward, and said why
            return Verdict(value=0.0, error_class="reference", details={"answer": (group.answer or "")[:100]})
        if written is None:
            return Verdict(value=0.0, format_error=True, error_class="format", components={"correct": 0.0})
        correct = integer_value(written) == reference
        return Verdict(value=1.0 if correct else 0.0, components={"correct": float(correct)})
