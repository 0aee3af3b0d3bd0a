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
