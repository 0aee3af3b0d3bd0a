"""The `code_tests` verifier: expected values never enter the sandbox, the candidate cannot speak for the
harness, and no sandbox output makes `verify()` raise.

Every attack runs in a real bubblewrap pool, scores 0 with its own error class, and is followed by a
correct answer on the same pool, which must still score 1.0. The property tests at the end give
`verify()` arbitrary sandbox results through a sandbox that returns a canned `SandboxResult`.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import ClassVar

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.sandbox import SandboxResult, SandboxSettings
from pipeline.sandbox.bubblewrap import BwrapSandboxPool
from schemas import PromptGroup
from workers.bench.hostile_programs import code_answer
from workers.rewards.verifiers import CodeTests
from workers.rewards.verifiers.code_tests import sandbox_program
from workers.rewards.verifiers.harness import HarnessRecord
from workers.rewards.verifiers.hidden_tests import (
    MAX_CASES,
    FloatTolerance,
    HiddenCase,
    InvalidHiddenTests,
    decode_hidden_tests,
    hidden_tests_json,
    json_equal,
)

ADD_CASES = [
    HiddenCase(args=[2, 3], expected=5),
    HiddenCase(args=[-2, 1], expected=-1),
    HiddenCase(args=[], kwargs={"a": 10, "b": 20}, expected=30),
]
CORRECT_ADD = "def add(a, b):\n    return a + b"
# Every case ends by itself within its CPU limit: the wall timeout is only a hang guard.
LIMITS = SandboxSettings(pool_size=2, wall_timeout_s=60, cpu_seconds=2, max_processes=24)

ERROR_CLASSES = {
    "invalid_tests",
    "format",
    "test_failed",
    "unserializable",
    "load_failed",
    "missing_result",
    "incomplete_result",
    "malformed_result",
    "oversized_result",
    "harness_error",
    # the sandbox's own (SandboxResult.error_class), but crash and killed, which the harness explains
    "timeout",
    "output_limit",
    "cpu",
    "file_size",
    "memory",
    "process_limit",
    "network",
    "permission",
    "open_files",
}


def _group(function: str = "add", cases: list[HiddenCase] = ADD_CASES, **suite) -> PromptGroup:
    return PromptGroup(
        run_id="r",
        group_id="g",
        task="code",
        prompt=f"write {function}",
        prompt_token_ids=[1],
        n_samples=1,
        metadata={"tests": hidden_tests_json(function, cases, **suite)},
    )


ADD = _group()


class RecordingSandbox:
    """The real pool, keeping each program it was given and each result it returned."""

    def __init__(self, pool: BwrapSandboxPool):
        self.pool, self.settings = pool, pool.settings
        self.programs: list[str] = []
        self.results: list[SandboxResult] = []

    async def run(self, program: str) -> SandboxResult:
        self.programs.append(program)
        self.results.append(await self.pool.run(program))
        return self.results[-1]


@pytest.fixture(scope="module")
async def pool():
    p = BwrapSandboxPool(LIMITS)
    await p.start()
    yield p
    await p.close()


@pytest.fixture
async def sandbox(pool):
    recording = RecordingSandbox(pool)
    yield recording
    healthy = await CodeTests().verify(code_answer(CORRECT_ADD), ADD, pool)
    assert healthy.value == 1.0, f"the pool no longer runs a correct answer: {healthy}"


async def _verify(sandbox, code: str, group: PromptGroup = ADD):
    verdict = await CodeTests().verify(code_answer(code), group, sandbox)
    assert verdict.error_class is None or verdict.error_class in ERROR_CLASSES, verdict
    assert (verdict.value == 1.0) == (verdict.error_class is None), verdict
    return verdict


# ---------------------------------------------------------------- honest answers


async def test_a_correct_answer_scores_1(sandbox):
    verdict = await _verify(sandbox, CORRECT_ADD)
    assert verdict.value == 1.0 and verdict.sandbox_id.startswith("bwrap-")
    assert verdict.components["passed"] == verdict.components["cases"] == 3.0


async def test_a_wrong_answer_names_the_first_failing_case(sandbox):
    verdict = await _verify(sandbox, "def add(a, b):\n    return abs(a + b)")
    assert verdict.error_class == "test_failed"
    assert verdict.details == {"case": "1", "expected": "-1", "got": "1"}
    assert verdict.components["passed"] == 2.0


async def test_an_exception_is_a_failed_case_named_by_its_type(sandbox):
    verdict = await _verify(sandbox, "def add(a, b):\n    return a / 0")
    assert verdict.error_class == "test_failed"
    assert verdict.details == {"case": "0", "expected": "5", "raised": "ZeroDivisionError"}


async def test_answers_that_do_not_run_or_define_nothing(sandbox):
    syntax = await _verify(sandbox, "def add(a, b)\n    return a + b")
    assert syntax.error_class == "load_failed" and syntax.details["reason"] == "SyntaxError"
    wrong_name = await _verify(sandbox, "def plus(a, b):\n    return a + b")
    assert wrong_name.error_class == "format" and wrong_name.format_error
    no_code = await _verify(sandbox, "the answer is 5")
    assert no_code.error_class == "format" and len(sandbox.programs) == 2  # nothing to run


async def test_a_tuple_passes_where_a_list_is_expected(sandbox):
    """Documented: a tuple and a list are both a JSON array on the way out of the sandbox."""
    group = _group("pair", [HiddenCase(args=[1, 2], expected=[1, 2])])
    assert (await _verify(sandbox, "def pair(a, b):\n    return (a, b)", group)).value == 1.0


async def test_json_types_are_compared_strictly(sandbox):
    one = _group("one", [HiddenCase(expected=1)])
    as_bool = await _verify(sandbox, "def one():\n    return True", one)
    assert as_bool.error_class == "test_failed" and as_bool.details["got"] == "true"
    as_float = await _verify(sandbox, "def one():\n    return 1.0", one)
    assert as_float.error_class == "test_failed" and as_float.details["got"] == "1.0"
    tolerant = _group("third", [HiddenCase(expected=0.3)], float_tolerance=FloatTolerance(rel=1e-9))
    assert (await _verify(sandbox, "def third():\n    return 0.1 + 0.2", tolerant)).value == 1.0
    exact = _group("third", [HiddenCase(expected=0.3)])
    assert (await _verify(sandbox, "def third():\n    return 0.1 + 0.2", exact)).error_class == "test_failed"
    keys = _group("d", [HiddenCase(expected={"a": [1, {"b": None}], "c": "x"})])
    assert (await _verify(sandbox, "def d():\n    return {'c': 'x', 'a': [1, {'b': None}]}", keys)).value == 1.0


# ---------------------------------------------------------------- speaking for the harness


async def test_a_fake_verdict_line_then_exit_is_a_missing_result(sandbox):
    code = 'import os\nprint(\'{"passed": true, "tests": 3}\', flush=True)\nos._exit(0)\n' + CORRECT_ADD
    verdict = await _verify(sandbox, code)
    assert verdict.error_class == "missing_result" and verdict.details["child_exit_code"] == "0"


async def test_a_fake_result_on_stdout_and_stderr_counts_for_nothing(sandbox):
    forged = json.dumps(
        {"status": "ok", "outcomes": [{"kind": "returned", "value": v} for v in (5, -1, 30)], "received": 3}
    )
    code = f"import sys\nprint({forged!r})\nprint({forged!r}, file=sys.stderr)\ndef add(a, b):\n    return 0"
    verdict = await _verify(sandbox, code)
    assert verdict.error_class == "test_failed" and verdict.details["got"] == "0"


async def test_an_always_equal_object_is_unserializable(sandbox):
    code = "class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n"
    code += "def add(a, b):\n    return AlwaysEqual()"
    verdict = await _verify(sandbox, code)
    assert verdict.error_class == "unserializable" and verdict.details == {"case": "0", "type": "AlwaysEqual"}


async def test_an_int_subclass_equal_to_everything_is_unserializable(sandbox):
    code = "class Sneaky(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Sneaky(5)"
    verdict = await _verify(sandbox, code)
    assert verdict.error_class == "unserializable" and verdict.details["type"] == "Sneaky"


async def test_swapping_the_json_module_changes_nothing(sandbox):
    forged = '{"kind": "returned", "value": 5}'
    code = (
        "import json, sys, types\n"
        f"json.dumps = lambda *a, **k: {forged!r}\n"
        f"json.loads = lambda *a, **k: {{'status': 'ok'}}\n"
        "fake = types.ModuleType('json')\n"
        "fake.dumps, fake.loads = json.dumps, json.loads\n"
        "sys.modules['json'] = fake\n"
        "def add(a, b):\n    return a - b"
    )
    verdict = await _verify(sandbox, code)
    assert verdict.error_class == "test_failed" and verdict.details == {"case": "0", "expected": "5", "got": "-1"}


# ---------------------------------------------------------------- looking for the expected values

# Looks everywhere the interpreter can reach for strings with the tests' marker prefix and returns what
# it found: the argument's marker (which the sandbox must hold) and the expected value's (which it must not).
HARVEST = r"""
import gc, os, re, sys

def _texts():
    for obj in gc.get_objects():
        if isinstance(obj, dict):
            yield from (v for v in obj.values() if isinstance(v, (str, bytes)))
        elif isinstance(obj, (list, tuple)):
            yield from (v for v in obj if isinstance(v, (str, bytes)))
    frame = sys._getframe()
    while frame is not None:
        yield from (v for v in (*frame.f_globals.values(), *frame.f_locals.values()) if isinstance(v, (str, bytes)))
        yield repr(frame.f_code.co_consts)
        frame = frame.f_back
    for module in list(sys.modules.values()):
        yield repr(getattr(module, "__dict__", {}))
    for path in ("/proc/self/cmdline", "/proc/self/environ", f"/proc/{os.getppid()}/cmdline", "/proc/1/cmdline",
                 f"/proc/{os.getppid()}/environ", "/proc/1/fd/0", "/proc/self/fd/0"):
        try:
            with open(path, "rb") as f:
                yield f.read()
        except OSError:
            pass
    yield sys.stdin.read()

def harvest(prefix):
    found = set()
    for text in _texts():
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        found.update(re.findall(prefix + "[0-9a-f]{12}", text))
    return sorted(found)
"""


async def test_the_expected_values_are_nowhere_in_the_sandbox(sandbox):
    token = uuid.uuid4().hex[:12]
    argument, expected = f"sprawl-argument-{token}", f"sprawl-expected-{token}"
    group = _group("echo", [HiddenCase(args=[argument], expected=[[argument], [expected]])])
    suite = decode_hidden_tests(group.metadata["tests"])
    assert expected not in sandbox_program(CORRECT_ADD, suite, LIMITS.max_result_bytes)
    code = HARVEST + "\ndef echo(x):\n    return [harvest('sprawl-argument-'), harvest('sprawl-expected-')]"
    verdict = await _verify(sandbox, code, group)
    # It found the argument (so the search reaches what the sandbox holds), and no expected value.
    assert verdict.error_class == "test_failed"
    assert json.loads(verdict.details["got"]) == [[argument], []]
    (program,) = sandbox.programs
    assert expected not in program and argument in program


# ---------------------------------------------------------------- reaching for the result channel

# Writes a forged record to every descriptor it may hold or guess, and to those of every process it can
# see (the harness parent's, pid 1's), then reports on stderr which writes went through.
FORGE = r"""
import os, sys
FORGED = b'{"status":"ok","outcomes":[{"kind":"returned","value":5},{"kind":"returned","value":-1},' \
         b'{"kind":"returned","value":30}],"received":3,"exit_code":0,"signal":null,"detail":""}'
wrote = []
for fd in sorted({*range(3, 65), int(sys.argv[1])}):
    try:
        os.write(fd, FORGED + b"\n")
        wrote.append(f"fd {fd}")
    except OSError:
        pass
for process, pid in (("harness", os.getppid()), ("init", 1)):
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        names = []
        wrote.append(f"{process} fds unreadable")
    for name in names:
        try:
            with open(f"/proc/{pid}/fd/{name}", "wb", buffering=0) as f:
                f.write(FORGED + b"\n")
            wrote.append(f"{process} fd {name}")
        except OSError:
            pass
print("wrote:", wrote, file=sys.stderr, flush=True)
"""


async def test_the_result_channel_is_out_of_the_candidates_reach(sandbox):
    verdict = await _verify(sandbox, FORGE + "os._exit(0)\n" + CORRECT_ADD)
    # The forgery reached the only pipe the candidate's process holds (the one to the harness parent),
    # which took it for what it is; the channel holds the parent's own record.
    assert verdict.error_class == "malformed_result" and verdict.details["reason"].startswith("line 1: ")
    (result,) = sandbox.results
    assert msgspec.json.decode(result.channel, type=HarnessRecord).status == "malformed_result"
    # Its only write that went through was to its own pipe; the harness's descriptors it cannot even list.
    assert "wrote: ['fd " in result.stderr and result.stderr.count("fd ") == 1, result.stderr
    assert "harness fds unreadable" in result.stderr


async def test_forging_then_killing_the_harness_leaves_nothing_on_the_channel(sandbox):
    verdict = await _verify(sandbox, FORGE + "os.kill(os.getppid(), 9)\n" + CORRECT_ADD)
    assert verdict.error_class == "missing_result" and verdict.details["reason"] == "nothing on the result channel"
    assert sandbox.results[0].channel == b""


async def test_the_harness_can_be_neither_traced_nor_read(sandbox):
    code = (
        "import ctypes, os\ndef add(a, b):\n"
        "    attached = ctypes.CDLL(None, use_errno=True).ptrace(16, os.getppid(), 0, 0)  # PTRACE_ATTACH\n"
        "    try:\n"
        "        open(f'/proc/{os.getppid()}/mem', 'rb').close()\n"
        "        memory = 'read'\n"
        "    except OSError as exc:\n"
        "        memory = type(exc).__name__\n"
        "    return [attached, memory]"
    )
    verdict = await _verify(sandbox, code)
    assert verdict.error_class == "test_failed" and json.loads(verdict.details["got"]) == [-1, "PermissionError"]


async def test_killing_the_harness_is_a_missing_result(sandbox):
    verdict = await _verify(sandbox, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + CORRECT_ADD)
    assert verdict.error_class == "missing_result" and verdict.details["signal"] == "9"


# ---------------------------------------------------------------- results that do not fit

HARNESS_PIPE = r"""
import os, stat

def harness_pipe():
    # The write end of the pipe to the harness parent: the only pipe the candidate holds past its
    # stdin, stdout and stderr.
    return next(fd for fd in range(3, 64) if _is_pipe(fd))

def _is_pipe(fd):
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False
"""


async def test_a_deeply_nested_return_value_is_unserializable(sandbox):
    code = "def add(a, b):\n    x = []\n    for _ in range(100_000):\n        x = [x]\n    return x"
    verdict = await _verify(sandbox, code)
    assert verdict.error_class == "unserializable" and "nested deeper" in verdict.details["type"]


async def test_deep_nesting_written_to_the_harness_pipe_is_malformed(sandbox):
    line = "b'{\"kind\":\"returned\",\"value\":' + b'[' * 100_000 + b']' * 100_000 + b'}\\n'"
    code = HARNESS_PIPE + f"def add(a, b):\n    os.write(harness_pipe(), {line})\n    os._exit(0)"
    verdict = await _verify(sandbox, code)
    assert (
        verdict.error_class == "malformed_result" and verdict.details["reason"] == "line 1: not JSON (RecursionError)"
    )


async def test_a_huge_return_value_is_an_oversized_result(sandbox):
    for huge in ("'x' * 10 ** 6", "list(range(10 ** 6))"):
        verdict = await _verify(sandbox, f"def add(a, b):\n    return {huge}")
        assert verdict.error_class == "oversized_result" and verdict.details["received"] == "0", huge
    flood = HARNESS_PIPE + "def add(a, b):\n    while True:\n        os.write(harness_pipe(), b'x' * 65536)"
    verdict = await _verify(sandbox, flood)
    assert verdict.error_class == "oversized_result" and "wrote more than" in verdict.details["reason"]


async def test_exiting_between_cases_is_an_incomplete_result(sandbox):
    code = "import os\ndef add(a, b):\n    if a < 0:\n        os._exit(0)\n    return a + b"
    verdict = await _verify(sandbox, code)
    assert verdict.error_class == "incomplete_result" and verdict.details["received"] == "1"


async def test_a_process_left_behind_does_not_hold_up_the_verdict(sandbox):
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(600)\ndef add(a, b):\n    return a - b"
    verdict = await _verify(sandbox, code)
    # Judged once the answer's own process ended, not when the wall clock killed the sandbox (a timeout).
    assert verdict.error_class == "test_failed" and not sandbox.results[-1].timed_out


async def test_a_limit_names_the_zero(sandbox):
    spin = await _verify(sandbox, "def add(a, b):\n    while True:\n        pass")
    assert spin.error_class == "cpu"
    bomb = await _verify(sandbox, "import os\nwhile True:\n    os.fork()\n" + CORRECT_ADD)
    assert bomb.error_class == "process_limit"
    hog = await _verify(sandbox, "x = bytearray(10 ** 10)\n" + CORRECT_ADD)
    assert hog.error_class == "memory"


# ---------------------------------------------------------------- the hidden tests themselves


async def test_tests_that_do_not_decode_are_the_authors_bug():
    """A 0 for every sample of the group (no advantage for GRPO) and a class that says why; nothing runs."""
    broken = PromptGroup(
        run_id="r",
        group_id="g",
        task="code",
        prompt="",
        prompt_token_ids=[1],
        n_samples=1,
        metadata={"tests": "def test_adds():\n    assert add(2, 3) == 5\n"},  # the old format
    )
    verdict = await CodeTests().verify(code_answer(CORRECT_ADD), broken, None)
    assert verdict.value == 0.0 and verdict.error_class == "invalid_tests" and verdict.details["reason"]


def test_hidden_tests_are_checked_when_built_and_when_decoded():
    text = hidden_tests_json("add", ADD_CASES, float_tolerance=FloatTolerance(abs=1e-9))
    suite = decode_hidden_tests(text)
    assert suite.function == "add" and suite.cases == ADD_CASES and suite.float_tolerance.abs == 1e-9
    for bad_case in (
        HiddenCase(expected=(1, 2)),
        HiddenCase(expected=float("nan")),
        HiddenCase(args=[{1, 2}], expected=1),
    ):
        with pytest.raises(InvalidHiddenTests):
            hidden_tests_json("f", [bad_case])
    for text in (
        '{"function": "class", "cases": [{"expected": 1}]}',  # a keyword
        '{"function": "f", "cases": []}',
        '{"function": "f", "cases": [{"args": [1]}]}',  # no expected value
        '{"function": "f", "cases": [{"expected": 1, "extra": 2}]}',
        '{"function": "f", "cases": [{"expected": ' + "[" * 100 + "]" * 100 + "}]}",
        '{"function": "f", "cases": [{"expected": ' + "[" * 100_000 + "]" * 100_000 + "}]}",
        '{"function": "f", "cases": [{"expected": 1}], "float_tolerance": {"abs": -1}}',
        json.dumps({"function": "f", "cases": [{"expected": 1}] * (MAX_CASES + 1)}),
        "",
    ):
        with pytest.raises(InvalidHiddenTests):
            decode_hidden_tests(text)


def test_json_equal_is_strict_unless_floats_are_tolerated():
    assert json_equal([1, {"a": None}], [1, {"a": None}])
    assert not json_equal(1, True) and not json_equal(True, 1) and not json_equal(5, 5.0) and not json_equal(5.0, 5)
    assert not json_equal({"a": 1}, {"a": 1, "b": 2}) and not json_equal([1], [1, 1]) and not json_equal("1", 1)
    tolerance = FloatTolerance(abs=1e-6)
    assert json_equal(5, 5.0000001, tolerance) and json_equal([0.3], [0.1 + 0.2], tolerance)
    assert not json_equal(True, 1.0, tolerance) and not json_equal(1.0, 10**400, tolerance)


# ---------------------------------------------------------------- whatever the sandbox returns


class CannedSandbox:
    """A sandbox that returns a given result: stands in for the sandbox's output, not its behaviour."""

    settings: ClassVar[SandboxSettings] = LIMITS

    def __init__(self, result: SandboxResult):
        self.result = result

    async def run(self, program: str) -> SandboxResult:
        return self.result


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)
_OUTCOME = st.one_of(
    st.builds(lambda v: {"kind": "returned", "value": v}, _JSON),
    st.builds(lambda n: {"kind": "raised", "exception": n}, st.text(max_size=300)),
    st.builds(lambda n: {"kind": "unserializable", "type": n}, st.text(max_size=300)),
    st.dictionaries(st.text(max_size=8), _JSON, max_size=3),
)
_RECORD = st.fixed_dictionaries(
    {
        "status": st.sampled_from(
            [
                "ok",
                "missing_result",
                "incomplete_result",
                "malformed_result",
                "load_failed",
                "missing_function",
                "oversized_result",
                "harness_error",
                "bogus",
            ]
        )
    },
    optional={
        "outcomes": st.lists(_OUTCOME, max_size=5),
        "received": st.integers(min_value=-2, max_value=10) | st.text(max_size=3),
        "exit_code": st.none() | st.integers(-300, 300),
        "signal": st.none() | st.integers(-5, 70),
        "detail": st.text(max_size=1000),
    },
)
_CHANNEL = st.one_of(
    st.binary(max_size=512),
    _RECORD.map(lambda r: json.dumps(r).encode()),
    _RECORD.map(lambda r: json.dumps(r).encode()[:-3]),
    st.integers(1, 50_000).map(lambda depth: b'{"status":"ok","outcomes":[{"kind":"returned","value":' + b"[" * depth),
    st.integers(1, 5_000).map(
        lambda depth: b'{"status":"ok","outcomes":[{"kind":"returned","value":' + b"[" * depth + b"]" * depth + b"}]}"
    ),
    st.sampled_from([b'{"passed": true, "tests": "x"}', b'{"passed": false}', b"[" * 100_000, b"\xff\xfe", b"null"]),
)
_RESULT = st.builds(
    SandboxResult,
    sandbox_id=st.just("canned"),
    exit_code=st.none() | st.integers(-300, 300),
    signal=st.none() | st.integers(-5, 70),
    stdout=st.text(max_size=200) | st.just('{"passed": true, "tests": "x"}\n{"passed": false}'),
    stderr=st.text(max_size=500) | st.sampled_from(["MemoryError", "\x1b[2J\x1b]0;pwned\x07BlockingIOError\r"]),
    duration_s=st.floats(0, 100),
    timed_out=st.booleans(),
    output_truncated=st.booleans(),
    cpu_limited=st.booleans(),
    channel=_CHANNEL,
)
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(result=_RESULT, cases=st.integers(1, 4))
def test_verify_never_raises_whatever_the_sandbox_returns(result, cases):
    group = _group("f", [HiddenCase(expected=[1, "a"])] * cases)
    verdict = asyncio.run(CodeTests().verify(code_answer(CORRECT_ADD), group, CannedSandbox(result)))
    assert verdict.value in (0.0, 1.0)
    assert (verdict.value == 1.0) == (verdict.error_class is None)
    assert verdict.error_class is None or verdict.error_class in ERROR_CLASSES
    assert all(
        isinstance(v, str) and not _CONTROLS.search(v.replace("\n", "").replace("\t", ""))
        for v in verdict.details.values()
    )
    if verdict.value == 1.0:  # only a well-formed record whose every outcome is the expected value
        record = msgspec.json.decode(result.channel, type=HarnessRecord)
        assert record.status == "ok" and [o.value for o in record.outcomes] == [[1, "a"]] * cases


def test_a_well_formed_record_of_right_outcomes_is_the_only_way_to_1():
    ok = {"status": "ok", "outcomes": [{"kind": "returned", "value": [1, "a"]}], "received": 1}
    result = SandboxResult(
        "canned", 1, None, "MemoryError", "PermissionError", 1.0, False, True, True, channel=json.dumps(ok).encode()
    )
    group = _group("f", [HiddenCase(expected=[1, "a"])])
    assert asyncio.run(CodeTests().verify(code_answer(CORRECT_ADD), group, CannedSandbox(result))).value == 1.0
    for channel in (json.dumps(ok).encode() * 2, json.dumps(ok | {"extra": 1}).encode(), b""):
        other = SandboxResult("canned", 0, None, "", "", 1.0, False, False, channel=channel)
        assert asyncio.run(CodeTests().verify(code_answer(CORRECT_ADD), group, CannedSandbox(other))).value == 0.0
