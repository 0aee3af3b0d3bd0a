"""Reading an answer out of a completion: shared by the verifiers that judge text."""

from __future__ import annotations

import re

from schemas import PromptGroup


def final_answer(text: str) -> str:
    """The last non-empty line, stripped: where the demo task's prompts ask for the answer."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def answer_format_ok(text: str, group: PromptGroup) -> bool:
    """A final answer exists and matches the group's `answer_format` regex, when it has one."""
    pattern = group.metadata.get("answer_format")
    answer = final_answer(text)
    if not answer:
        return False
    return bool(re.fullmatch(pattern, answer)) if pattern else True


_NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?", re.ASCII)
"""An ASCII decimal number: optional minus, digits (thousands may be comma-grouped), optional fraction.
Other scripts' digits (Arabic-Indic, full-width) are not read as numbers: what counts as the answer
stays exactly what a reader of the ASCII reference would take it to be."""


def last_number(text: str) -> str | None:
    """The last number written in `text`, as it is written, or None."""
    last = None
    for last in _NUMBER.finditer(text):  # noqa: B007 (only the last match is wanted)
        pass
    return last.group() if last is not None else None


def integer_value(number: str) -> str | None:
    """`number` (as `last_number` returns it, or a reference answer) as canonical integer digits:
    no grouping commas, no leading zeros, no sign on zero, a fraction only when it is all zeros; None
    when it is not an integer. Compared as text: no int() of a number with 10^5 digits."""
    if not _NUMBER.fullmatch(number):
        return None
    negative = number.startswith("-")
    whole, _, fraction = number.lstrip("-").replace(",", "").partition(".")
    if fraction.strip("0"):
        return None
    digits = whole.lstrip("0") or "0"
    return f"-{digits}" if negative and digits != "0" else digits
