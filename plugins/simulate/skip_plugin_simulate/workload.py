"""The shape of each sample: how many tokens it generates, in how many turns.

A sample is drawn from a generator seeded by the run's seed and the sample's own identity
(epoch, prompt, offset), so every schedule simulated on one config sees the same samples:
their throughputs compare side by side, as the benchmark's schedules share one task.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

from skip_plugin_simulate.config import Requests


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int
    turns: list[int]  # tokens generated in each turn
    tool_tokens: int
    tool_s: float


#: Added to the run's seed for the validation prompts' samples, apart from the training ones.
VALIDATION_SEED = 1_000_003


class Workload:
    """Samples from the parametric model of ``requests``, or, given ``groups`` (each prompt's
    samples as a profile measured them), a measured prompt drawn whole, so its samples keep
    what they shared."""

    def __init__(self, spec: Requests, seed: int, groups: list[list[Shape]] | None = None) -> None:
        self.spec, self.seed, self.groups = spec, seed, groups

    def sample(self, epoch: int, prompt: int, offset: int) -> Shape:
        if self.groups:
            group = self.groups[int(_uniforms(self.seed, epoch, prompt, -1)[0] * len(self.groups))]
            return group[offset % len(group)]
        s = self.spec
        hardness = _normal(self.seed, epoch, prompt, -1)
        spread = _normal(self.seed, epoch, prompt, offset)
        length = s.response_median * math.exp(s.prompt_sigma * hardness + s.sample_sigma * spread)
        total = int(min(max(round(length), s.turns), s.max_response_length))
        share, extra = divmod(total, s.turns)
        turns = [share + (i < extra) for i in range(s.turns) if share + (i < extra)]
        return Shape(s.prompt_tokens, turns, s.tool_tokens, s.tool_s)


def _uniforms(*key: int) -> tuple[float, float]:
    """Two uniforms in [0, 1) from a hash of ``key``: a generator per sample would cost tens of
    microseconds, and a step of 10,000 samples draws 20,000."""
    digest = hashlib.blake2b(struct.pack(f"<{len(key)}q", *key), digest_size=16).digest()
    a, b = struct.unpack("<QQ", digest)
    return a / 2**64, b / 2**64


def _normal(*key: int) -> float:
    u, v = _uniforms(*key)
    return math.sqrt(-2.0 * math.log(1.0 - u)) * math.cos(2.0 * math.pi * v)  # Box-Muller
