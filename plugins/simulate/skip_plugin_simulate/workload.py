"""The shape of each sample: how many tokens it generates, in how many turns.

A sample is drawn from a generator seeded by the run's seed and the sample's own identity
(epoch, prompt, offset), so every schedule simulated on one config sees the same samples:
their throughputs compare side by side, as the benchmark's schedules share one task.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from skip_plugin_simulate.config import Requests


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int
    turns: list[int]  # tokens generated in each turn
    tool_tokens: int
    tool_s: float


class Workload:
    """Samples from the parametric model of ``requests``, or, given ``groups`` (each prompt's
    samples as a profile measured them), a measured prompt drawn whole, so its samples keep
    what they shared."""

    def __init__(self, spec: Requests, seed: int, groups: list[list[Shape]] | None = None) -> None:
        self.spec, self.seed, self.groups = spec, seed, groups

    def sample(self, epoch: int, prompt: int, offset: int) -> Shape:
        if self.groups:
            group = self.groups[np.random.default_rng([self.seed, epoch, prompt]).integers(len(self.groups))]
            return group[offset % len(group)]
        s = self.spec
        hardness = np.random.default_rng([self.seed, epoch, prompt]).standard_normal()
        spread = np.random.default_rng([self.seed, epoch, prompt, offset + 1]).standard_normal()
        length = s.response_median * np.exp(s.prompt_sigma * hardness + s.sample_sigma * spread)
        total = int(min(max(round(length), s.turns), s.max_response_length))
        turns = [len(part) for part in np.array_split(np.arange(total), s.turns) if len(part)]
        return Shape(s.prompt_tokens, turns, s.tool_tokens, s.tool_s)
