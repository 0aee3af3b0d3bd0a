"""Hidden tests of a code task as data: which function to call, with which inputs, expecting what.

A prompt group of a code task carries them as JSON in `metadata["tests"]` (build it with
`hidden_tests_json`):

    {"function": "add",
     "cases": [{"args": [2, 3], "kwargs": {}, "expected": 5}, ...],
     "float_tolerance": {"abs": 1e-9, "rel": 1e-6}}          # optional

Tests are data, not code, so that the expected values never have to enter the sandbox: only the
function name and each case's arguments go in, what the function returned comes back, and the host
compares it here. Every value is plain JSON (null, true/false, integers, finite floats, strings,
lists, objects), nested at most `MAX_DEPTH` deep, with integers of at most `MAX_INT_BITS` bits (the
sandbox's interpreter refuses to parse longer ones).

How an outcome is judged (`json_equal`): the same JSON type, recursively, and equal: `True` is not
`1`, `5.0` is not `5`, objects are compared by their keys. A float is compared with a tolerance only
where the suite sets `float_tolerance` (then any two numbers that are not booleans are compared with
`math.isclose(got, expected, rel_tol=rel, abs_tol=abs)`; two integers still exactly). A tuple
returned where a list is expected passes: both are JSON arrays on the way out of the sandbox.
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Iterable
from typing import Annotated, Any

import msgspec

__all__ = [
    "MAX_CASES",
    "MAX_DEPTH",
    "MAX_INT_BITS",
    "FloatTolerance",
    "HiddenCase",
    "HiddenTests",
    "InvalidHiddenTests",
    "decode_hidden_tests",
    "hidden_tests_json",
    "json_equal",
    "json_value_problem",
]

MAX_CASES = 256
"""Cases per suite: every outcome must come back through the sandbox's capped result channel."""
MAX_DEPTH = 64
"""How deep a value (an argument, an expected value, a returned one) may nest lists and objects."""
MAX_INT_BITS = 14_000
"""The largest integer, in bits (about 4200 decimal digits: under the 4300 digits Python's `int(str)`
accepts by default, which the sandbox's json module relies on)."""


class InvalidHiddenTests(ValueError):
    """A suite that does not decode or breaks a rule above: the task author's bug, not the policy's."""


class FloatTolerance(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    abs: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    rel: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class HiddenCase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One call: `function(*args, **kwargs)` must return `expected`."""

    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    expected: Any


class HiddenTests(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    function: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=100)]
    """The name the answer must define (a top-level callable)."""
    cases: Annotated[list[HiddenCase], msgspec.Meta(min_length=1, max_length=MAX_CASES)]
    float_tolerance: FloatTolerance | None = None
    """None: floats must be equal exactly (and of type float)."""

    def __post_init__(self) -> None:  # msgspec turns these ValueErrors into ValidationErrors on decode
        if keyword.iskeyword(self.function):
            raise ValueError(f"function name {self.function!r} is a Python keyword")
        for index, case in enumerate(self.cases):
            for where, value in (("args", case.args), ("kwargs", case.kwargs), ("expected", case.expected)):
                if (problem := json_value_problem(value)) is not None:
                    raise ValueError(f"case {index} {where}: {problem}")


def json_value_problem(value: Any, depth: int = 0) -> str | None:
    """Why `value` is not plain JSON data within the limits above (None: it is). Exact types only: a
    subclass of int or str, a tuple, a set, NaN, an integer over `MAX_INT_BITS` bits are problems."""
    kind = type(value)
    if depth > MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH}"
    if value is None or kind in (bool, str):
        return None
    if kind is int:
        return None if value.bit_length() <= MAX_INT_BITS else f"an integer over {MAX_INT_BITS} bits"
    if kind is float:
        return None if math.isfinite(value) else f"a float that is not finite ({value!r})"
    if kind is list:
        return next((p for item in value if (p := json_value_problem(item, depth + 1)) is not None), None)
    if kind is dict:
        if any(type(key) is not str for key in value):
            return "an object with a key that is not a string"
        return next((p for item in value.values() if (p := json_value_problem(item, depth + 1)) is not None), None)
    return f"a {kind.__name__}, not a JSON value"


def decode_hidden_tests(text: str) -> HiddenTests:
    """The suite in a prompt group's `metadata["tests"]`, or `InvalidHiddenTests` saying why not."""
    try:
        return msgspec.json.decode(text, type=HiddenTests)
    except (msgspec.MsgspecError, RecursionError) as exc:  # RecursionError: nesting past msgspec's own limit
        raise InvalidHiddenTests(str(exc) or type(exc).__name__) from None


def hidden_tests_json(
    function: str, cases: Iterable[HiddenCase], *, float_tolerance: FloatTolerance | None = None
) -> str:
    """The `metadata["tests"]` value for a prompt group, checked: it decodes back to the same suite, or
    `InvalidHiddenTests` says why (a tuple, a set or NaN in a case, say: JSON could not carry it as is).

        hidden_tests_json("add", [HiddenCase(args=[2, 3], expected=5), HiddenCase(args=[-2, 1], expected=-1)])
    """
    suite_cases = list(cases)
    for index, case in enumerate(suite_cases):
        for where, value in (("args", case.args), ("kwargs", case.kwargs), ("expected", case.expected)):
            if (problem := json_value_problem(value)) is not None:
                raise InvalidHiddenTests(f"case {index} {where}: {problem}")
    text = msgspec.json.encode(
        HiddenTests(function=function, cases=suite_cases, float_tolerance=float_tolerance)
    ).decode()
    decode_hidden_tests(text)  # the rules the verifier will apply, applied now
    return text


def json_equal(expected: Any, got: Any, tolerance: FloatTolerance | None = None, depth: int = 0) -> bool:
    """Whether `got` is `expected` as JSON data: the same type at every level and equal (see the module
    docstring for floats). Anything nested deeper than `MAX_DEPTH` is not equal."""
    if depth > MAX_DEPTH:
        return False
    want, have = type(expected), type(got)
    if tolerance is not None and want in (int, float) and have in (int, float) and float in (want, have):
        try:
            return math.isclose(got, expected, rel_tol=tolerance.rel, abs_tol=tolerance.abs)
        except OverflowError:  # an integer too large for a float is not close to any float
            return False
    if want is not have:
        return False
    if want is list:
        return len(expected) == len(got) and all(
            json_equal(e, g, tolerance, depth + 1) for e, g in zip(expected, got, strict=True)
        )
    if want is dict:
        return expected.keys() == got.keys() and all(
            json_equal(expected[key], got[key], tolerance, depth + 1) for key in expected
        )
    return bool(expected == got)
