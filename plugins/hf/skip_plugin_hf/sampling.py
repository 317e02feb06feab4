"""Per-row sampling: every row of a batch keeps its own temperature, top-k, top-p and random stream."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence

import torch
from skip_core.backend import SamplingParams, logprob_temperature


def seeded_stream(seed: int, sample: int) -> random.Random:
    """The random stream of sample ``sample`` of a request with ``seed``: ``Random(seed * 1_000_003 + sample)``."""
    return random.Random(seed * 1_000_003 + sample)


class Sampler:
    """Picks one token per row by inverse CDF from one uniform draw of that row's stream.

    A row's token then depends only on its logits and its stream, never on its neighbours in the
    batch, which is what makes a seeded request reproducible whatever it is batched with.
    """

    def __init__(self, params: Sequence[SamplingParams], streams: Sequence[random.Random], device: torch.device):
        self.streams = list(streams)
        self.device = device
        self.temperature = torch.tensor([[logprob_temperature(p.temperature)] for p in params], device=device)
        self.greedy = torch.tensor([p.temperature == 0 for p in params], device=device)
        self.top_k = torch.tensor([[p.top_k if p.top_k > 0 else sys.maxsize] for p in params], device=device)
        self.top_p = torch.tensor([[p.top_p] for p in params], device=device)
        self.filters = any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params)

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled token ids and their log-probs (at the row's temperature, before filtering)."""
        logprobs = (logits.float() / self.temperature).log_softmax(-1)
        uniform = torch.tensor([stream.random() for stream in self.streams], dtype=torch.float64, device=self.device)
        tokens = self._filtered(logprobs, uniform) if self.filters else _inverse_cdf(logprobs.exp(), uniform)
        tokens = torch.where(self.greedy, logits.argmax(-1), tokens)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)

    def select(self, rows: torch.Tensor, keep: Sequence[int]) -> None:
        """Keep only the given rows (``rows`` holds the same indices as a device tensor)."""
        self.streams = [self.streams[i] for i in keep]
        self.temperature, self.greedy = self.temperature[rows], self.greedy[rows]
        self.top_k, self.top_p = self.top_k[rows], self.top_p[rows]

    def merge(self, other: Sampler) -> None:
        """Append ``other``'s rows after these."""
        self.streams += other.streams
        self.temperature = torch.cat([self.temperature, other.temperature])
        self.greedy = torch.cat([self.greedy, other.greedy])
        self.top_k, self.top_p = torch.cat([self.top_k, other.top_k]), torch.cat([self.top_p, other.top_p])
        self.filters = self.filters or other.filters

    def _filtered(self, logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        # Top-k first, then top-p over the renormalised survivors (the order vLLM and HF use).
        ordered, order = logprobs.sort(-1, descending=True)
        rank = torch.arange(ordered.shape[-1], device=self.device)
        probs = ordered.masked_fill(rank >= self.top_k, float("-inf")).softmax(-1)
        # Keep the shortest prefix reaching top_p; the first token always survives.
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= self.top_p, 0.0)
        return order.gather(-1, _inverse_cdf(probs, uniform)[:, None]).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    # Strictly below the total: the first entry above the target then has a non-zero probability.
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)
