"""The console every ``skip`` command prints to, the core's and the plugins'. Everything it
renders passes through ``skip_core.escaping.printable`` (its own styles are added after, so
colours survive): no name from disk can drive the terminal, whichever command prints it.
"""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment

from skip_core.escaping import CONTROL, escape

_KEPT_ON_CONSOLE = "\n\t"  # line breaks and tabs of the console's own layout


class _Printable:
    """A renderable whose text segments are ``printable`` (line breaks and tabs kept)."""

    def __init__(self, renderable: object) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for segment in console.render(self.renderable, options):
            if segment.control or not CONTROL.search(segment.text):
                yield segment
            else:
                text = CONTROL.sub(lambda m: m[0] if m[0] in _KEPT_ON_CONSOLE else escape(m), segment.text)
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
