"""`code_tests`: the answer is Python; the sandbox says what its function returns on the hidden inputs,
and the host compares that with the expected outputs, which never enter the sandbox.

The hidden tests are data (`hidden_tests.py`): a function name and cases of arguments and expected
values. Only the name and the arguments go into the sandbox, inside the harness (`harness.py`),
which runs the answer in a child process and sends back, on the sandbox's private result channel,
what the function returned (or raised) for each case. The answer's stdout and stderr play no part
in the verdict, and a value is judged on what it is as JSON data, not on what its `__eq__` says.

Reward 1.0 iff every case returned exactly its expected value. Otherwise 0.0 and one `error_class`:

- `invalid_tests`: the prompt group's tests do not decode (the task author's bug; nothing is run).
- `format`: no code in the answer, or it defines no callable of the tests' name.
- `test_failed`: a case returned something else, or raised (details: the case, expected and got, or
  the exception's name).
- `unserializable`: a case returned what JSON cannot carry as is (a set, a subclass, NaN, nesting
  past the limit); details name it.
- a class of the sandbox's when the program ended on a limit: `timeout`, `output_limit`, `cpu`,
  `memory`, `process_limit`, `file_size`, `open_files`, `network`, `permission` (see
  `SandboxResult.error_class`).
- `load_failed`: the answer raised while being run, before any case (a SyntaxError, say).
- what became of the results: `missing_result` (none came back: the harness was killed, or the
  answer's process ended before its first case), `incomplete_result` (some cases did not come back),
  `malformed_result` (what came back is not outcomes), `oversized_result` (more than the channel
  carries), `harness_error` (the harness itself failed).

Which wins: a complete record of outcomes is judged whatever else happened (the answer can print
anything, or be killed after its last case: what it returned is known). Without one, a limit the
sandbox names comes first, then what the harness says went wrong. So the answer can choose which
zero it gets (by printing "MemoryError" and dying, say), never the value: classes past `test_failed`
are diagnostics, as is the stderr tail in their details.
"""

from __future__ import annotations

import re
import textwrap
from typing import TYPE_CHECKING, Any

import msgspec

from pipeline.logs import get_logger
from pipeline.safe_text import strip_terminal_controls
from pipeline.sandbox import SandboxResult, SandboxSettings
from schemas import PromptGroup, Trajectory
from workers.rewards.verifiers.harness import HarnessRecord, Raised, Returned, Unserializable, harness_program
from workers.rewards.verifiers.hidden_tests import HiddenTests, InvalidHiddenTests, decode_hidden_tests, json_equal
from workers.rewards.verifiers.verdict import Verdict

if TYPE_CHECKING:
    from pipeline.sandbox import Sandbox

log = get_logger(__name__)

_CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)

DETAIL_CHARS = 300
"""How much of any one value, name or output a verdict's details keep."""

_LEFT_TO_THE_HARNESS = frozenset({None, "crash", "killed"})
"""Sandbox classes that do not outrank what the harness says: a crash or a kill (the answer killing
its own harness, say) is explained better by which results came back."""


def extract_code(text: str) -> str | None:
    """The first fenced Python block (or the whole text), if it defines a function at all."""
    match = _CODE_BLOCK.search(text)
    code = match.group(1) if match else text
    return code if "def " in code else None


def sandbox_program(code: str, suite: HiddenTests, result_cap: int) -> str:
    """What the sandbox runs: the harness with the answer, the function's name and the arguments. No
    expected value is in it."""
    calls = [(case.args, case.kwargs) for case in suite.cases]
    return harness_program(textwrap.dedent(code), suite.function, calls, result_cap)


def _cut(text: str) -> str:
    """Safe to store and show: no terminal controls, at most DETAIL_CHARS characters."""
    text = strip_terminal_controls(text)
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."


def _as_json(value: Any) -> str:
    try:
        return msgspec.json.encode(value).decode()
    except (msgspec.MsgspecError, RecursionError, OverflowError):
        return repr(value)[: DETAIL_CHARS * 2]


def _decode_record(channel: bytes) -> tuple[HarnessRecord | None, str]:
    """The harness's record, or None and why not. The bytes are untrusted (whatever killed the harness
    may have written them), already capped by the sandbox: any decoder failure is a malformed result."""
    if not channel:
        return None, "nothing on the result channel"
    try:
        return msgspec.json.decode(channel, type=HarnessRecord), ""
    except Exception as exc:  # msgspec's errors, RecursionError (deep nesting), MemoryError: never raise
        return None, f"the result channel holds no record ({type(exc).__name__}: {exc})"


def _judge_outcomes(verdict: Verdict, suite: HiddenTests, outcomes: list[Any]) -> Verdict:
    """1.0 iff every outcome is its case's expected value as JSON data; else the first case that is not."""
    passed, first_failure = 0, None
    for index, (case, outcome) in enumerate(zip(suite.cases, outcomes, strict=True)):
        if isinstance(outcome, Returned) and json_equal(case.expected, outcome.value, suite.float_tolerance):
            passed += 1
            continue
        if first_failure is not None:
            continue
        first_failure = {"case": str(index)}
        if isinstance(outcome, Returned):
            verdict.error_class = "test_failed"
            first_failure |= {"expected": _cut(_as_json(case.expected)), "got": _cut(_as_json(outcome.value))}
        elif isinstance(outcome, Raised):
            verdict.error_class = "test_failed"
            first_failure |= {"expected": _cut(_as_json(case.expected)), "raised": _cut(outcome.exception)}
        else:
            assert isinstance(outcome, Unserializable)
            verdict.error_class = "unserializable"
            first_failure |= {"type": _cut(outcome.type)}
    verdict.components["passed"] = float(passed)
    if first_failure is None:
        verdict.value = 1.0
    else:
        verdict.details = first_failure
    return verdict


def judge(result: SandboxResult, suite: HiddenTests) -> Verdict:
    """The verdict on one run of `sandbox_program`: never raises, whatever the sandbox returned."""
    verdict = Verdict(
        value=0.0,
        sandbox_id=result.sandbox_id,
        components={"duration_s": result.duration_s, "cases": float(len(suite.cases))},
    )
    record, why_not = _decode_record(result.channel)
    if record is not None and record.status == "ok":
        if len(record.outcomes) == len(suite.cases):
            return _judge_outcomes(verdict, suite, record.outcomes)
        record, why_not = None, f"an ok record with {len(record.outcomes)} outcomes for {len(suite.cases)} cases"
    details = {"exit_code": str(result.exit_code), "signal": str(result.signal)}
    if result.stderr:
        details["stderr_tail"] = _cut(result.stderr[-DETAIL_CHARS:])
    if record is not None:
        details |= {"received": str(record.received), "child_exit_code": str(record.exit_code)}
        details |= {"child_signal": str(record.signal)}
        if record.detail:
            details["reason"] = _cut(record.detail)
    elif why_not:
        details["reason"] = _cut(why_not)
    verdict.details = details
    if (sandbox_class := result.error_class) not in _LEFT_TO_THE_HARNESS:
        verdict.error_class = sandbox_class
    elif record is None:
        verdict.error_class = "missing_result" if not result.channel else "malformed_result"
    elif record.status == "missing_function":
        verdict.error_class, verdict.format_error = "format", True
        details["reason"] = _cut(f"no callable named {suite.function!r} (found: {record.detail})")
    else:
        verdict.error_class = record.status
    return verdict


def _result_cap(sandbox: Sandbox) -> int:
    """The sandbox's `max_result_bytes` (backends that keep their settings say it), else the default."""
    settings = getattr(sandbox, "settings", None)
    return settings.max_result_bytes if isinstance(settings, SandboxSettings) else SandboxSettings().max_result_bytes


class CodeTests:
    name, version, needs_sandbox = "code_tests", "2", True

    async def verify(self, trajectory: Trajectory, group: PromptGroup, sandbox: Sandbox) -> Verdict:
        try:
            suite = decode_hidden_tests(group.metadata.get("tests", ""))
        except InvalidHiddenTests as exc:
            # Not the policy's fault, so not its reward to lose: every sample of the group gets the same
            # 0 (no advantage in GRPO), and the class says why. Loud, since someone must fix the task.
            log.error("hidden tests do not decode", group_id=group.group_id, task=group.task, error=str(exc)[:500])
            return Verdict(value=0.0, error_class="invalid_tests", details={"reason": _cut(str(exc))})
        code = extract_code(trajectory.text)
        if code is None:
            return Verdict(value=0.0, format_error=True, error_class="format", details={"reason": "no function"})
        result = await sandbox.run(sandbox_program(code, suite, _result_cap(sandbox)))
        return judge(result, suite)
