"""The program the `code_tests` verifier runs in the sandbox, and the record it leaves on the result channel.

The harness is trusted code that runs the candidate's untrusted code without letting it speak for
the harness. It receives, embedded in its own text (the program arrives on stdin), the candidate's
source, the function's name and each case's arguments: never an expected value, so nothing in the
sandbox knows what the right answer is.

It makes itself non-dumpable (so no process of the same uid can open its `/proc/<pid>/fd/*`, read its
memory or attach to it with ptrace; where the sandbox has a seccomp filter, it denies ptrace
outright), opens a pipe and forks:

- the child closes the result channel (the write end the sandbox passed as `sys.argv[1]`: after
  that no process but the parent holds it), runs the candidate's source as `__main__` in a fresh
  module, calls the function on each case and writes one line per case on the pipe (`Outcome`
  below, JSON), then exits. Everything from here on runs after candidate code in the same process,
  so whatever the child writes is untrusted: the candidate can write anything to that pipe.
- the parent never runs candidate code. It reads the child's pipe (capped), waits for the child,
  checks every line strictly, and writes one `HarnessRecord` (JSON) on the result channel: the
  outcomes, or what went wrong. Then it ends the way the child ended (the same exit code, or the same
  signal), so that the sandbox's own classification (a CPU limit, a crash) still sees it.

Child to parent, one JSON object per line, one line per case in order:

    {"kind": "returned", "value": <JSON value>}         the function returned this (a tuple as a list)
    {"kind": "raised", "exception": "ZeroDivisionError"}
    {"kind": "unserializable", "type": "set"}           it returned something that is not plain JSON
                                                        (a subclass, a set, NaN, nested too deep)
    {"kind": "oversized"}                               (last) this case's value would overflow the cap

or a single line instead, when there is nothing to call:

    {"kind": "load_failed", "exception": "SyntaxError"}   the source raised while being run
    {"kind": "missing_function", "type": "NoneType"}      no callable of that name once it ran

The parent reads at most `child_cap` bytes (`max_result_bytes` less 1 KiB): past it, it kills the child
(`oversized_result`). Every line must be one of the above with exactly those fields, end in a newline
(unless a signal cut the child off mid-line), hold finite numbers, integers of at most
`MAX_INT_BITS` bits, UTF-8 strings, no duplicate keys and nesting of at most `MAX_DEPTH`; anything
else is a `malformed_result` naming the line. More lines than cases is malformed too.

Parent to host, on the result channel: exactly one `HarnessRecord`, at most `max_result_bytes`, e.g.

    {"status": "ok", "outcomes": [...], "received": 3, "exit_code": 0, "signal": null, "detail": ""}
    {"status": "incomplete_result", "outcomes": [], "received": 1, "exit_code": 0, "signal": null, ...}
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from workers.rewards.verifiers.hidden_tests import MAX_CASES, MAX_DEPTH, MAX_INT_BITS

__all__ = [
    "HARNESS_STATUSES",
    "MAX_NAME_CHARS",
    "HarnessRecord",
    "Outcome",
    "Raised",
    "Returned",
    "Unserializable",
    "harness_program",
]

MAX_NAME_CHARS = 200
"""An exception's or a type's name in an outcome (the candidate names its own classes)."""


class Returned(msgspec.Struct, frozen=True, tag_field="kind", tag="returned", forbid_unknown_fields=True):
    value: Any


class Raised(msgspec.Struct, frozen=True, tag_field="kind", tag="raised", forbid_unknown_fields=True):
    exception: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]


class Unserializable(msgspec.Struct, frozen=True, tag_field="kind", tag="unserializable", forbid_unknown_fields=True):
    type: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
    """What it was: its type's name, and why it could not be carried where the type is a JSON one."""


Outcome = Returned | Raised | Unserializable

HarnessStatus = Literal[
    "ok",
    "missing_result",
    "incomplete_result",
    "malformed_result",
    "oversized_result",
    "load_failed",
    "missing_function",
    "harness_error",
]
HARNESS_STATUSES: tuple[str, ...] = HarnessStatus.__args__


class HarnessRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the harness parent writes on the result channel: the only thing the verdict trusts."""

    status: HarnessStatus
    """`ok`: one outcome per case. Otherwise what went wrong: the child sent no outcome
    (`missing_result`) or fewer than there are cases (`incomplete_result`), sent bytes that are not
    outcomes (`malformed_result`) or more than fit (`oversized_result`), the source raised while being
    run (`load_failed`), it defines no callable of that name (`missing_function`), or the harness
    itself failed (`harness_error`)."""
    outcomes: Annotated[list[Outcome], msgspec.Meta(max_length=MAX_CASES)] = []
    received: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Well-formed outcomes that came back from the child."""
    exit_code: int | None = None
    """How the child ended: its exit code, or (`signal`) the signal that ended it; both None when the
    harness killed it (past the size cap) or never started it."""
    signal: int | None = None
    detail: Annotated[str, msgspec.Meta(max_length=4 * MAX_NAME_CHARS)] = ""
    """The exception name (`load_failed`, `harness_error`), the type found (`missing_function`), or what
    was malformed and where."""


_INPUT_MARK = "__SPRAWL_HARNESS_INPUT__"

# Runs under the sandbox's own interpreter (`python3 -I -S`: the standard library only). Kept in one
# string so that what runs in the sandbox is exactly what is reviewed here.
# Runs under the sandbox's own interpreter (`python3 -I -S`: the standard library only). One string, so
# that what runs in the sandbox is exactly what is reviewed here.
_HARNESS = r'''
import ctypes, json, os, select, signal, sys, traceback, types

_INPUT = json.loads(__SPRAWL_HARNESS_INPUT__)
_CHANNEL = int(sys.argv[1])
_PR_SET_DUMPABLE = 4
_MAX_DEPTH, _MAX_INT_BITS = _INPUT["max_depth"], _INPUT["max_int_bits"]


# ---------------------------------------------------------------- the child: runs the candidate

class _NotPlain(Exception):
    pass


class _TooLarge(Exception):
    pass


def _plain(value, depth, budget, _type=type, _len=len, _str=str):
    """`value` as JSON data (a tuple as a list), or _NotPlain saying why it is not: exact types only.
    `budget`: about how many bytes are left for outcomes (_TooLarge past it)."""
    kind = _type(value)
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooLarge()
    if depth > _MAX_DEPTH:
        raise _NotPlain(kind.__name__ + " nested deeper than " + _str(_MAX_DEPTH))
    if value is None or kind is bool:
        return value
    if kind is int:
        if value.bit_length() > _MAX_INT_BITS:
            raise _NotPlain("int over " + _str(_MAX_INT_BITS) + " bits")
        budget[0] -= value.bit_length() // 4
        return value
    if kind is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise _NotPlain("float " + repr(value))
        return value
    if kind is str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _NotPlain("str that is not UTF-8 (a lone surrogate)") from None
        budget[0] -= _len(value)
        if budget[0] < 0:
            raise _TooLarge()
        return value
    if kind is list or kind is tuple:
        return [_plain(item, depth + 1, budget) for item in value]
    if kind is dict:
        out = {}
        for key, item in value.items():
            if _type(key) is not str:
                raise _NotPlain("dict with a " + _type(key).__name__ + " key")
            out[_plain(key, depth + 1, budget)] = _plain(item, depth + 1, budget)
        return out
    raise _NotPlain(kind.__name__)


def _name(cls):
    try:
        name = cls.__name__
    except BaseException:
        name = None
    return name[:100] if type(name) is str and name else "?"


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _child(write_fd):
    """Everything after `exec` runs after candidate code, in its process: as untrusted as it is."""
    _exit, _dumps, _write = os._exit, json.dumps, _write_all
    status = 70
    try:
        os.close(_CHANNEL)  # first: from here on only the parent holds the result channel

        def emit(record):
            line = _dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            _write(write_fd, line.encode() + b"\n")

        module = types.ModuleType("__main__")
        sys.modules["__main__"] = module
        try:
            exec(compile(_INPUT["source"], "<candidate>", "exec"), module.__dict__)
        except BaseException as exc:
            try:
                traceback.print_exc()  # on stderr the sandbox tells a MemoryError or a fork bomb by it
            except BaseException:
                pass
            emit({"kind": "load_failed", "exception": _name(type(exc))})
            status = 1
            return
        function = module.__dict__.get(_INPUT["function"])
        if not callable(function):
            emit({"kind": "missing_function", "type": _name(type(function))})
            status = 1
            return
        budget = [_INPUT["child_cap"]]
        for args, kwargs in _INPUT["calls"]:
            try:
                value = function(*args, **kwargs)
            except BaseException as exc:
                emit({"kind": "raised", "exception": _name(type(exc))})
                continue
            try:
                emit({"kind": "returned", "value": _plain(value, 0, budget)})
            except _NotPlain as why:
                emit({"kind": "unserializable", "type": str(why.args[0])[:100]})
            except _TooLarge:
                emit({"kind": "oversized"})
                break
            except RecursionError:
                emit({"kind": "unserializable", "type": _name(type(value)) + " nested too deep"})
        status = 0
    except BaseException:
        status = 70
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        _exit(status)


# ---------------------------------------------------------------- the parent: trusts nothing it reads

class _Malformed(Exception):
    pass


def _no_constants(name):
    raise _Malformed("a non-JSON constant " + name[:20])


def _no_duplicates(pairs):
    if len({key for key, _ in pairs}) != len(pairs):
        raise _Malformed("an object with a duplicate key")
    return dict(pairs)


def _check_value(value, depth):
    kind = type(value)
    if depth > _MAX_DEPTH:
        raise _Malformed("a value nested deeper than " + str(_MAX_DEPTH))
    if value is None or kind is bool:
        return
    if kind is float:
        # NaN and the infinities as tokens are refused by _no_constants; 1e999 still parses to inf.
        if value != value or value in (float("inf"), float("-inf")):
            raise _Malformed("a float that is not finite")
        return
    if kind is int:
        if value.bit_length() > _MAX_INT_BITS:
            raise _Malformed("an integer over " + str(_MAX_INT_BITS) + " bits")
    elif kind is str:
        value.encode("utf-8")  # a lone surrogate written as an escape: UnicodeEncodeError, malformed
    elif kind is list:
        for item in value:
            _check_value(item, depth + 1)
    elif kind is dict:
        for key, item in value.items():
            _check_value(key, depth + 1)
            _check_value(item, depth + 1)
    else:
        raise _Malformed("a " + kind.__name__)


_FIELDS = {
    "returned": "value",
    "raised": "exception",
    "unserializable": "type",
    "load_failed": "exception",
    "missing_function": "type",
    "oversized": None,
}


def _parse_line(line):
    """One line from the child as an outcome, or _Malformed saying why not."""
    try:
        record = json.loads(line.decode("utf-8"), parse_constant=_no_constants, object_pairs_hook=_no_duplicates)
        if type(record) is not dict or record.get("kind") not in _FIELDS:
            raise _Malformed("not an outcome")
        kind, field = record["kind"], _FIELDS[record["kind"]]
        if set(record) != ({"kind", field} if field else {"kind"}):
            raise _Malformed("a " + kind + " outcome with other fields")
        if kind == "returned":
            _check_value(record["value"], 0)
        elif field is not None:
            name = record[field]
            if type(name) is not str or not 0 < len(name) <= 100:
                raise _Malformed("a " + field + " that is not a short string")
            name.encode("utf-8")
        return record
    except _Malformed:
        raise
    except Exception as exc:  # bad UTF-8, bad JSON, RecursionError (deep nesting), a huge integer, ...
        raise _Malformed("not JSON (" + type(exc).__name__ + ")") from None


def _drain(fd, data, cap):
    """Append what the pipe holds now, reading no further once past `cap`; True at EOF."""
    while len(data) <= cap:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not chunk:
            return True
        data += chunk
    return False


def _collect(read_fd, pid, cap):
    """(what the child wrote, its wait status, whether it wrote past `cap` and was killed). Ends when the
    child has ended, not at EOF: a process it left behind may hold the pipe open for ever."""
    data = bytearray()
    os.set_blocking(read_fd, False)
    at_eof = False
    while True:
        if not at_eof:
            select.select([read_fd], [], [], 0.05)
            at_eof = _drain(read_fd, data, cap)
        if len(data) > cap:
            os.kill(pid, signal.SIGKILL)
            return data, os.waitpid(pid, 0)[1], True
        ended, status = os.waitpid(pid, 0 if at_eof else os.WNOHANG)
        if ended:
            if not at_eof:
                _drain(read_fd, data, cap)  # what it wrote just before it ended
            return data, status, len(data) > cap


def _record(status, outcomes=(), received=0, exit_code=None, signal_number=None, detail=""):
    return {"status": status, "outcomes": list(outcomes), "received": received, "exit_code": exit_code,
            "signal": signal_number, "detail": detail}


def _verdict_record(data, wait_status, overflowed):
    cases = len(_INPUT["calls"])
    ended = {"exit_code": None, "signal_number": None}
    if overflowed:
        pass  # we killed it: how it ended says nothing about the candidate
    elif os.WIFSIGNALED(wait_status):
        ended["signal_number"] = os.WTERMSIG(wait_status)
    else:
        ended["exit_code"] = os.WEXITSTATUS(wait_status)
    # Complete lines only. A last line without its newline was cut off: at the cap, or as a signal
    # ended the child; otherwise the child wrote bytes that are not a line (checked after the lines).
    *lines, tail = bytes(data[: _INPUT["child_cap"]]).split(b"\n")
    outcomes = []
    for number, line in enumerate(lines, 1):
        where = "line " + str(number) + ": "
        try:
            outcome = _parse_line(line)
        except _Malformed as why:
            if overflowed:
                break
            return _record("malformed_result", (), len(outcomes), detail=where + str(why.args[0]), **ended)
        kind = outcome["kind"]
        if kind in ("load_failed", "missing_function") and number == len(lines) == 1:
            return _record(kind, detail=outcome[_FIELDS[kind]], **ended)
        if kind == "oversized" and not overflowed:
            return _record("oversized_result", (), len(outcomes), **ended,
                           detail="case " + str(len(outcomes)) + " returned more than the " + str(_INPUT["child_cap"])
                           + " bytes all outcomes may take")
        if kind not in ("returned", "raised", "unserializable"):
            if overflowed:
                break
            return _record("malformed_result", (), len(outcomes), detail=where + "a " + kind + " among outcomes",
                           **ended)
        if len(outcomes) == cases:
            if overflowed:
                break
            return _record("malformed_result", (), len(outcomes), **ended,
                           detail=where + "more outcomes than the " + str(cases) + " cases")
        outcomes.append(outcome)
    if overflowed:
        return _record("oversized_result", (), len(outcomes), **ended,
                       detail="the candidate's process wrote more than " + str(_INPUT["child_cap"]) + " bytes")
    if tail and ended["signal_number"] is None:
        return _record("malformed_result", (), len(outcomes), **ended,
                       detail="line " + str(len(lines) + 1) + ": no newline at its end")
    if not outcomes:
        return _record("missing_result", **ended)
    if len(outcomes) < cases:
        return _record("incomplete_result", (), len(outcomes), **ended)
    return _record("ok", outcomes, len(outcomes), **ended)


def _encode(record):
    return json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _main():
    wait_status, overflowed = None, True
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
        read_fd, write_fd = os.pipe()
        # The child shares our uid and may signal us: a catchable signal must not end us before the
        # record is written (SIGKILL and SIGSTOP cannot be helped: no record, or the wall timeout).
        # Ignored before the fork, or a child that signals at once beats us to it; the child gets the
        # usual handlers back before the candidate's code runs.
        saved = {}
        for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGTSTP",
                     "SIGTTIN", "SIGTTOU", "SIGVTALRM", "SIGPROF", "SIGPOLL", "SIGPWR"):
            if hasattr(signal, name):
                number = getattr(signal, name)
                saved[number] = signal.signal(number, signal.SIG_IGN)
        pid = os.fork()
        if pid == 0:
            for number, handler in saved.items():
                signal.signal(number, handler)
            os.close(read_fd)
            _child(write_fd)  # never returns: it ends in os._exit
        os.close(write_fd)
        data, wait_status, overflowed = _collect(read_fd, pid, _INPUT["child_cap"])
        record = _verdict_record(data, wait_status, overflowed)
        encoded = _encode(record)
        if len(encoded) > _INPUT["result_cap"]:  # re-encoding can grow a value ("1e5" is 100000.0)
            detail = "the outcomes take more than " + str(_INPUT["result_cap"]) + " bytes"
            record = _record("oversized_result", (), record["received"], record["exit_code"], record["signal"], detail)
            encoded = _encode(record)
    except BaseException as exc:
        encoded = _encode(_record("harness_error", detail=_name(type(exc)) + ": " + str(exc)[:300]))
    _write_all(_CHANNEL, encoded)
    os.close(_CHANNEL)
    # End as the child ended (unless we killed it), so that the sandbox's own classification (a CPU
    # limit, a crash) sees how the candidate's process ended.
    if wait_status is not None and not overflowed and os.WIFSIGNALED(wait_status):
        number = os.WTERMSIG(wait_status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be (and need not be) reset
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    if wait_status is not None and not overflowed and os.WIFEXITED(wait_status):
        os._exit(os.WEXITSTATUS(wait_status))
    os._exit(0)


_main()
'''


def harness_program(source: str, function: str, calls: list[tuple[list[Any], dict[str, Any]]], result_cap: int) -> str:
    """The harness with its input embedded: the candidate's source, the function's name and each case's
    arguments (a JSON text in a Python string literal), never an expected value. `result_cap`: the
    sandbox's `max_result_bytes`; the record never takes more (it says `oversized_result` instead)."""
    spec = {
        "source": source,
        "function": function,
        "calls": [[list(args), dict(kwargs)] for args, kwargs in calls],
        "result_cap": result_cap,
        # What the child may send: the record needs a little room beside its outcomes.
        "child_cap": max(result_cap - 1024, 1),
        "max_depth": MAX_DEPTH,
        "max_int_bits": MAX_INT_BITS,
    }
    literal = repr(json.dumps(spec, ensure_ascii=True, allow_nan=False))
    return _HARNESS.replace(_INPUT_MARK, literal, 1)
