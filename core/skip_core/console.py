"""The console every ``skip`` command prints to, the core's and the plugins', and the one
sanitiser of what reaches it from disk.

Names of files and directories, roles in a ``meta.json``, a log's values: any of them may hold
terminal escape sequences (``ESC[2J`` clears the screen, OSC sets the window title, ``ESC[8m``
hides what follows) or bidirectional overrides that make a name read as another. ``printable``
escapes them; the console applies it to everything it renders (its own styles are added after,
so colours survive), and one-line errors and warnings apply it to their message.
"""

from __future__ import annotations

import re

from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment

# C0 controls, DEL, C1 controls, and the format characters that reorder or hide text.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
_KEPT_ON_CONSOLE = "\n\t"  # line breaks and tabs of the console's own layout


def _escape(match: re.Match) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object) -> str:
    """``str(text)`` with every control and invisible-format character escaped (``\\x1b``,
    ``\\u202e``), line breaks included: safe on one terminal line."""
    return _CONTROL.sub(_escape, str(text))


class _Printable:
    """A renderable whose text segments are ``printable`` (line breaks and tabs kept)."""

    def __init__(self, renderable: object) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for segment in console.render(self.renderable, options):
            if segment.control or not _CONTROL.search(segment.text):
                yield segment
            else:
                text = _CONTROL.sub(lambda m: m[0] if m[0] in _KEPT_ON_CONSOLE else _escape(m), segment.text)
                yield Segment(text, segment.style)


class _Sanitised:
    """A render hook (rich's ``RenderHook``) that passes every renderable through ``_Printable``."""

    def process_renderables(self, renderables: list) -> list:
        return [_Printable(renderable) for renderable in renderables]


# Pipes and CI logs get 80 columns by default, which would fold every path: give tables room, and
# never fold a line there (a path cut in two is found by no grep).
_TERMINAL = Console().is_terminal
console = Console(width=None if _TERMINAL else 160, soft_wrap=not _TERMINAL)
console.push_render_hook(_Sanitised())
