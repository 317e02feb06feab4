"""The console every ``skip`` command prints to, the core's and the plugins'."""

from rich.console import Console

# Pipes and CI logs get 80 columns by default, which would fold every path: give tables room, and
# never fold a line there (a path cut in two is found by no grep).
_TERMINAL = Console().is_terminal
console = Console(width=None if _TERMINAL else 160, soft_wrap=not _TERMINAL)
