"""The shape of each sample: how many tokens it generates, in how many turns.

A sample's randomness is a hash of the run's seed and the sample's own identity (epoch,
prompt, offset), so every schedule simulated on one config sees the same samples: their
throughputs compare side by side, as the benchmark's schedules share one task. The hash is
computed for a whole generation at once: a step of 10,000 samples costs one numpy pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from skip_plugin_simulate.config import Requests


@dataclass(frozen=True, slots=True)
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

    def draw(self, epochs: np.ndarray, prompts: np.ndarray, offsets: np.ndarray) -> list[Shape]:
        """The shapes of the samples ``(epochs[i], prompts[i], offsets[i])``."""
        prompt_key = _key(self.seed, epochs, prompts)
        if self.groups:
            picks = (_uniforms(prompt_key, -1)[0] * len(self.groups)).astype(np.int64).tolist()
            return [self._measured(pick, offset) for pick, offset in zip(picks, offsets.tolist(), strict=True)]
        s = self.spec
        hardness, spread = _normal(prompt_key, np.stack([np.full_like(offsets, -1), offsets]))  # one pass for both
        length = np.rint(s.response_median * np.exp(s.prompt_sigma * hardness + s.sample_sigma * spread))
        totals = np.clip(length, s.turns, s.max_response_length).astype(np.int64).tolist()
        return [Shape(s.prompt_tokens, _split(total, s.turns), s.tool_tokens, s.tool_s) for total in totals]

    def _measured(self, pick: int, offset: int) -> Shape:
        group = self.groups[pick]
        return group[offset % len(group)]


def _split(total: int, turns: int) -> list[int]:
    if turns == 1:
        return [total]
    share, extra = divmod(total, turns)
    return [share + (i < extra) for i in range(turns) if share + (i < extra)]


#: Odd 64-bit multipliers that spread each key over the whole word before mixing.
_SEED, _EPOCH, _PROMPT, _OFFSET = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93


def _key(seed: int, epochs: np.ndarray, prompts: np.ndarray) -> np.ndarray:
    """Each sample's prompt, as one word of the hash's input (the offset is added per draw)."""
    word = np.asarray(epochs).astype(np.uint64) * np.uint64(_EPOCH) + np.uint64(seed * _SEED % 2**64)
    return word + np.asarray(prompts).astype(np.uint64) * np.uint64(_PROMPT)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every bit of the input moves every bit of the output."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _uniforms(prompt_key: np.ndarray, offsets: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
    """Two uniforms in [0, 1) per sample, from a hash of its prompt's key and its offset."""
    h = _mix(prompt_key + np.asarray(offsets).astype(np.int64).astype(np.uint64) * np.uint64(_OFFSET))
    scale = 2.0**-53
    return (h >> np.uint64(11)) * scale, (_mix(h ^ np.uint64(_SEED)) >> np.uint64(11)) * scale


def _normal(prompt_key: np.ndarray, offsets: np.ndarray | int) -> np.ndarray:
    u, v = _uniforms(prompt_key, offsets)
    return np.sqrt(-2.0 * np.log1p(-u)) * np.cos(2.0 * np.pi * v)  # Box-Muller
