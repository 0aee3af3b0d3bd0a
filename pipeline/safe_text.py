"""Text from untrusted programs made safe to store and show: no terminal control characters.

Program output (a sandboxed candidate's stderr, an exception name it chose) ends up in verdict
details, the log and the audit tables, and from there on someone's terminal. An escape sequence in
it could rewrite the screen, retitle the window, hide lines (a carriage return) or, on some
terminals, answer back; so whole escape sequences are removed, then every remaining control
character except newline and tab.
"""

from __future__ import annotations

import re

__all__ = ["strip_terminal_controls"]

_ESCAPE_SEQUENCES = re.compile(
    r"""
      (?:\x1b\[|\x9b) [0-?]* [\x20-/]* [@-~]              # CSI: ESC [ (or 8-bit CSI), parameters, final byte
    | (?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]) .*? (?:\x07|\x1b\\|\x9c|\Z)
                                                          # OSC, DCS, SOS, PM, APC: up to their terminator
                                                          # (or the end: a terminal would swallow the rest too)
    | \x1b [\x20-/]* [0-~]                                # every other escape: ESC, intermediates, final byte
    """,
    re.VERBOSE | re.DOTALL,
)

_CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""C0 controls but tab (0x09) and newline (0x0a), DEL, and the C1 controls."""


def strip_terminal_controls(text: str) -> str:
    """`text` without ANSI escape sequences (removed whole) and without control characters other
    than newline and tab. Printable text, non-ASCII included, is kept as it was."""
    return _CONTROL_CHARACTERS.sub("", _ESCAPE_SEQUENCES.sub("", text))
