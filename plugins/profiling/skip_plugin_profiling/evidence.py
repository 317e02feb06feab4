"""How many requests (or steps, or spans) back a comparison the report states, and the
minimum below which it is left out rather than stated.

"3-turn requests took 5.1× one-turn ones" reads the same whether the one-turn side is three
requests or three thousand; only the first is noise. So every stated comparison names the
count behind each side, and one whose smaller side is below the minimum is not stated: the
report says what was left out and why instead.
"""

from __future__ import annotations

#: The fewest requests (or spans) a side of a comparison may rest on: a mean or median of
#: fewer moves with a single odd request.
MIN_COUNT = 10
#: The fewest steps whose median a single step is compared with (a peak): a step's rollout
#: time is one measurement, the median of the steps is its baseline.
MIN_STEPS = 5


def sides(a: int, b: int, noun: str = "") -> str:
    """``n=3 vs n=61 requests``: the counts behind the two sides, in the order they are named."""
    return f"n={a} vs n={b}" + (f" {noun}" if noun else "")
