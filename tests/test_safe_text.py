"""strip_terminal_controls: no control character but newline and tab survives, escape sequences go whole,
and printable text (non-ASCII included) is untouched."""

import re

from hypothesis import given
from hypothesis import strategies as st

from pipeline.safe_text import strip_terminal_controls

FORBIDDEN = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def test_escape_sequences_are_removed_whole():
    assert strip_terminal_controls("\x1b[31mred\x1b[0m plain") == "red plain"
    assert strip_terminal_controls("a\x1b[2J\x1b[1;1Hb") == "ab"  # clear screen, move cursor
    assert strip_terminal_controls("\x1b]0;pwned title\x07after") == "after"  # window title (BEL-terminated)
    assert strip_terminal_controls("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\") == "link"  # hyperlink (ST)
    assert strip_terminal_controls("\x1bP+q544e\x1b\\ok") == "ok"  # DCS (a terminal query)
    assert strip_terminal_controls("\x9b31mred\x9b0m") == "red"  # 8-bit CSI
    assert strip_terminal_controls("\x1b(Bx\x1bcy\x1b7z") == "xyz"  # charset, reset, save cursor
    assert strip_terminal_controls("\x1b]0;never terminated") == ""


def test_control_characters_but_newline_and_tab_are_removed():
    assert strip_terminal_controls("ok\rHIDDEN\x08\x08\x07\x00\x7f\x85\x9c end") == "okHIDDEN end"
    assert strip_terminal_controls("line 1\n\tline 2") == "line 1\n\tline 2"
    assert strip_terminal_controls("unterminated \x1b[12") == "unterminated 12"
    assert strip_terminal_controls("lone escape\x1b") == "lone escape"


def test_printable_text_is_kept():
    text = "Traceback (most recent call last):\n  ZeroDivisionError: división ÷ 0 — 零 😀"
    assert strip_terminal_controls(text) == text


@given(st.text())
def test_no_control_character_survives_and_stripping_is_idempotent(text):
    stripped = strip_terminal_controls(text)
    assert not FORBIDDEN.search(stripped)
    assert strip_terminal_controls(stripped) == stripped


@given(st.text(alphabet=st.characters(blacklist_categories=("Cc",))))
def test_text_without_controls_is_unchanged(text):
    assert strip_terminal_controls(text) == text
