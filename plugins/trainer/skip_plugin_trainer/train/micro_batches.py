"""A rank's batch cut into micro-batches: ``ppo_micro_batch_size`` rows, or verl's token budgets
(``use_dynamic_bsz``), under which a long-tail batch's longest rows no longer decide everyone's.

skip's forward pass computes a micro-batch's rows over the span of its longest prompt and longest
response (``policy.response_outputs``: padding included, nothing removed), so the tokens a
micro-batch costs are its rows x that span, and that is what a budget bounds. Samples are packed
longest first, which keeps rows of like length together and the padding small. Sharded, every
rank must run as many forward passes as its peers (each gathers every layer with them), so the
count is the largest any rank needs, its bins split until it has that many.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from skip_core.batch import Batch

from skip_plugin_trainer.train.distributed import most


@dataclass(frozen=True)
class Split:
    """``micros`` in the order they run; ``order[k]``: the batch row of their concatenation's row
    ``k`` (None: the batch's own order)."""

    micros: list[Batch]
    order: torch.Tensor | None = None

    def restore(self, joined: torch.Tensor) -> torch.Tensor:
        """Per-row results of the micro-batches, concatenated, back in the batch's row order."""
        if self.order is None:
            return joined
        restored = torch.empty_like(joined)
        restored[self.order] = joined
        return restored


def split(batch: Batch, rows: int, budget: int | None) -> Split:
    """``batch`` in micro-batches of ``rows`` rows, or (``budget``) of at most ``budget`` tokens each."""
    if budget is None:
        return Split([batch[start : start + rows] for start in range(0, len(batch), rows)])
    bins = pack(*spans(batch), budget)
    bins = equalise(bins, most(len(bins)))
    order = torch.tensor([row for rows_ in bins for row in rows_], dtype=torch.long)
    return Split([batch[torch.tensor(rows_, dtype=torch.long)] for rows_ in bins], order)


def spans(batch: Batch) -> tuple[list[int], list[int]]:
    """Each row's prompt tokens (its span left of the response) and response span (to its last
    attended token; at least 1, as ``response_outputs`` keeps one column)."""
    mask = batch.batch["attention_mask"].bool()
    prompt_width = mask.shape[1] - batch.batch["responses"].shape[1]
    columns = torch.arange(mask.shape[1])
    first = torch.where(mask, columns, mask.shape[1]).min(dim=1).values
    last = torch.where(mask, columns, -1).max(dim=1).values
    prompts = (prompt_width - first).clamp(min=0)
    responses = (last + 1 - prompt_width).clamp(min=1)
    return prompts.tolist(), responses.tolist()


def pack(prompts: list[int], responses: list[int], budget: int) -> list[list[int]]:
    """Rows (longest first) in bins whose rows x (longest prompt + longest response) <= ``budget``."""
    bins: list[list[int]] = []
    current: list[int] = []
    prompt = response = 0
    for row in sorted(range(len(prompts)), key=lambda r: prompts[r] + responses[r], reverse=True):
        wider = max(prompt, prompts[row]), max(response, responses[row])
        if current and (len(current) + 1) * sum(wider) > budget:
            bins.append(current)
            current, wider = [], (prompts[row], responses[row])
        if sum(wider) > budget:
            raise ValueError(
                f"a sample of {sum(wider)} tokens is longer than the micro-batch budget of {budget} tokens "
                "(*_max_token_len_per_gpu must hold the longest sample)"
            )
        current.append(row)
        prompt, response = wider
    return [*bins, current] if current else bins


def equalise(bins: list[list[int]], count: int) -> list[list[int]]:
    """``bins`` split (the one of most rows in halves, its longer rows first) until there are
    ``count``; a part of a bin fits its budget as the bin did."""
    bins = [list(rows) for rows in bins]
    while len(bins) < count:
        largest = max(range(len(bins)), key=lambda index: len(bins[index]))
        rows = bins[largest]
        if len(rows) < 2:
            raise ValueError(f"{sum(map(len, bins))} samples cannot make the {count} micro-batches another rank runs")
        bins[largest : largest + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return bins
