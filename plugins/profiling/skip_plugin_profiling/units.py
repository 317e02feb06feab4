"""Durations and shares as a reader wants them: in a unit that fits their size.

The same report reads a tiny local run (a tool call of 40 µs) and a cluster run (a rollout of
20 min); one fixed unit prints "0.0 s" for one and a six-digit number for the other. Every
sentence and table cell of the report goes through these two functions.
"""

from __future__ import annotations

import math

# (upper bound in seconds, scale, unit): the first unit whose rounded value stays below the bound.
_UNITS = ((1e-3, 1e6, "µs"), (1.0, 1e3, "ms"), (100.0, 1.0, "s"))


def duration(seconds: float | None) -> str:
    """Three significant digits in µs, ms or s; whole seconds to 10 min, then min, then h."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    if seconds < 0:
        return "-" + duration(-seconds)
    if seconds == 0:
        return "0 s"
    for bound, scale, unit in _UNITS:
        value = float(f"{seconds * scale:.3g}")  # rounding may carry into the next unit
        if value < bound * scale:
            return f"{value:g} {unit}"
    if seconds < 600:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{float(f'{seconds / 60:.3g}'):g} min"
    return f"{float(f'{seconds / 3600:.3g}'):g} h"


def share(fraction: float | None) -> str:
    """A fraction as a percentage: whole percents from 10%, one decimal below, "<0.1%" for crumbs."""
    if fraction is None or not math.isfinite(fraction):
        return "n/a"
    if abs(fraction) < 1e-9:  # float noise of a difference, not a crumb
        return "0%"
    if abs(fraction) < 0.0005:
        return "<0.1%"
    return f"{fraction:.0%}" if abs(fraction) >= 0.0995 else f"{fraction:.1%}"
