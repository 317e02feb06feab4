"""The one kind of error the ``skip`` command prints as a single line.

A ``SkipError``'s message names the key or the file at fault and the way out; the command's
boundary (``skip_core.cli``) prints it alone, with no traceback, and exits 1. Anything else
escaping a command is a bug, and keeps its traceback.
"""

from __future__ import annotations

#: Set to 1 to see the traceback of a ``SkipError`` too (Hydra's own switch, which ``skip run`` users know).
TRACEBACK_SWITCH = "HYDRA_FULL_ERROR"


class SkipError(Exception):
    """An error a user can act on; its message is one line naming the key or file and the way out."""
