"""`code_tests`: the answer is Python; the prompt group's hidden tests run with it in the sandbox.

Reward 1 iff every test passes, else 0 with the first failing test named (the SWE-style reward), or
with the sandbox's error class when the program never got that far (a fork bomb, a timeout, ...).
"""

from __future__ import annotations

import json
import re
import textwrap

from schemas import PromptGroup, Trajectory
from workers.rewards.verifiers.verdict import Verdict

_CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)

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
    """The first fenced Python block (or the whole text), if it defines a function at all."""
    match = _CODE_BLOCK.search(text)
    code = match.group(1) if match else text
    return code if "def " in code else None


class CodeTests:
    name, version, needs_sandbox = "code_tests", "1", True

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
