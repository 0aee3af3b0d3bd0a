"""Verifiers: a trajectory's answer in, a verdict out. The reward worker routes by the prompt group's task.

A verifier is one module here plus one entry in `VERIFIERS`:

- `exact` (`exact.py`): the demo task's exact-answer check.
- `format` (`format_check.py`): flags malformed answers without judging them.
- `number` (`numeric.py`): the last number in the completion equals the integer answer (word problems).
- `code_tests` (`code_tests.py`): runs the answer's function on the hidden tests' inputs in the sandbox
  (through the harness in `harness.py`) and compares what it returned with the expected outputs, which
  stay on the host. A code task's prompt group carries its tests as data (`hidden_tests.py`): build
  `metadata["tests"]` with `hidden_tests_json("add", [HiddenCase(args=[2, 3], expected=5)])`.

Every verdict carries the format flag, so format errors are counted whatever the task. A verifier
says whether it executes model output (`needs_sandbox`); the worker requires a sandbox only then.
"""

from __future__ import annotations

from pipeline.errors import SprawlError
from workers.rewards.verifiers.answers import answer_format_ok, final_answer, integer_value, last_number
from workers.rewards.verifiers.code_tests import CodeTests, extract_code
from workers.rewards.verifiers.exact import ExactAnswer
from workers.rewards.verifiers.format_check import FormatCheck
from workers.rewards.verifiers.hidden_tests import FloatTolerance, HiddenCase, HiddenTests, hidden_tests_json
from workers.rewards.verifiers.numeric import NumericAnswer
from workers.rewards.verifiers.verdict import Verdict, Verifier

__all__ = [
    "VERIFIERS",
    "CodeTests",
    "ExactAnswer",
    "FloatTolerance",
    "FormatCheck",
    "HiddenCase",
    "HiddenTests",
    "NumericAnswer",
    "Verdict",
    "Verifier",
    "answer_format_ok",
    "extract_code",
    "final_answer",
    "hidden_tests_json",
    "integer_value",
    "last_number",
    "verifier",
]

VERIFIERS: dict[str, Verifier] = {v.name: v for v in (ExactAnswer(), FormatCheck(), NumericAnswer(), CodeTests())}
"""Verifier name (the values of the reward worker's `routes`) -> the verifier."""


def verifier(name: str) -> Verifier:
    try:
        return VERIFIERS[name]
    except KeyError:
        raise SprawlError(
            f"unknown verifier {name!r}",
            hint=f"route tasks (SPRAWL_ROUTES) to one of {', '.join(sorted(VERIFIERS))}",
        ) from None
