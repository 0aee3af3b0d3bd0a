"""Verifiers: a trajectory's answer in, a verdict out. Routed by the prompt group's task.

- `exact`: the demo task's exact-answer check (the answer is the last line, compared verbatim).
- `code_tests`: the answer is Python; the prompt group's hidden tests run with it in the sandbox;
  reward 1 iff every test passes, else 0 with the first failing test named (the SWE-style reward).
- `format`: flags malformed answers without judging them (the collapse monitor counts these).
Every verdict carries the format flag, so format errors are counted whatever the task.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass, field

from schemas import PromptGroup, Trajectory

_CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


@dataclass
class Verdict:
    value: float
    error_class: str | None = None
    format_error: bool = False
    sandbox_id: str | None = None
    components: dict[str, float] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)


def final_answer(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def answer_format_ok(text: str, group: PromptGroup) -> bool:
    pattern = group.metadata.get("answer_format")
    answer = final_answer(text)
    if not answer:
        return False
    return bool(re.fullmatch(pattern, answer)) if pattern else True


class ExactAnswer:
    name, version = "exact", "1"

    async def verify(self, trajectory: Trajectory, group: PromptGroup, sandbox) -> Verdict:
        ok_format = answer_format_ok(trajectory.text, group)
        correct = group.answer is not None and final_answer(trajectory.text) == group.answer.strip()
        return Verdict(
            value=1.0 if correct else 0.0,
            format_error=not ok_format,
            error_class=None if ok_format else "format",
            components={"correct": float(correct)},
        )


class FormatCheck:
    name, version = "format", "1"

    async def verify(self, trajectory: Trajectory, group: PromptGroup, sandbox) -> Verdict:
        ok = answer_format_ok(trajectory.text, group)
        return Verdict(value=1.0 if ok else 0.0, format_error=not ok, error_class=None if ok else "format")


_HARNESS = """

def _sprawl_run_hidden_tests():
    import json, sys, traceback
    names = sorted(n for n, f in list(globals().items()) if n.startswith("test_") and callable(f))
    for name in names:
        try:
            globals()[name]()
        except BaseException as exc:
            print(json.dumps({"passed": False, "failed_test": name, "error": type(exc).__name__}), flush=True)
            return
    print(json.dumps({"passed": True, "tests": len(names)}), flush=True)

_sprawl_run_hidden_tests()
"""


def extract_code(text: str) -> str | None:
    match = _CODE_BLOCK.search(text)
    code = match.group(1) if match else text
    return code if "def " in code else None


class CodeTests:
    name, version = "code_tests", "1"

    async def verify(self, trajectory: Trajectory, group: PromptGroup, sandbox) -> Verdict:
        code = extract_code(trajectory.text)
        if code is None:
            return Verdict(value=0.0, format_error=True, error_class="format", details={"reason": "no function"})
        tests = group.metadata.get("tests", "")
        program = f"{textwrap.dedent(code)}\n\n{tests}\n{_HARNESS}"
        result = await sandbox.run(program)
        outcome = None
        for line in reversed(result.stdout.splitlines()):
            if line.startswith("{") and '"passed"' in line:
                try:
                    outcome = json.loads(line)
                except ValueError:
                    outcome = None
                break
        verdict = Verdict(value=0.0, sandbox_id=result.sandbox_id, components={"duration_s": result.duration_s})
        if result.error_class is not None and not (outcome and outcome.get("passed")):
            verdict.error_class = result.error_class
            verdict.details = {"stderr_tail": result.stderr[-300:]}
        elif outcome is None:
            verdict.error_class = "no_result"
        elif outcome["passed"]:
            verdict.value = 1.0
            verdict.components["tests"] = float(outcome.get("tests", 0))
        else:
            verdict.error_class = "test_failed"
            verdict.details = {"failed_test": outcome["failed_test"], "error": outcome.get("error", "")}
        return verdict


VERIFIERS = {v.name: v for v in (ExactAnswer(), FormatCheck(), CodeTests())}
