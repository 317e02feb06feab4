"""Text from disk made safe to print: ``printable`` escapes what a terminal would act on.

Names of files and directories, roles in a ``meta.json``, a log's values, a pickle's strings: any
of them may hold terminal escape sequences (``ESC[2J`` clears the screen, OSC sets the window
title, ``ESC[8m`` hides what follows) or bidirectional overrides that make a name read as another.
No dependency: modules that build a message long before anything is printed import it freely.
"""

from __future__ import annotations

import re

# C0 controls, DEL, C1 controls, and the format characters that reorder or hide text.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


def escape(match: re.Match) -> str:
    """One matched character as its escape, ``\\x1b`` or ``\\u202e``."""
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object) -> str:
    """``str(text)`` with every control and invisible-format character escaped (``\\x1b``,
    ``\\u202e``), line breaks included: safe on one terminal line."""
    return CONTROL.sub(escape, str(text))
