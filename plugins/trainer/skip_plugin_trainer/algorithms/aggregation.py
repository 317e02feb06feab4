"""Masked statistics and verl's loss aggregation modes, shared by every policy loss, the value
loss and the advantage estimators. Tensors are ``[batch, response_len]``; ``mask`` is 1 on the
tokens the policy sampled and 0 on padding and tool responses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Average over loss tokens only; an empty mask gives 0 rather than NaN so empty batches stay finite."""
    mask = mask.to(values.dtype)
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp_min(1e-8)


def masked_var(values: Tensor, mask: Tensor) -> Tensor:
    """The unbiased variance over loss tokens, as verl's; it needs at least two of them."""
    mask = mask.to(values.dtype)
    count = mask.sum()
    if count < 2:
        raise ValueError("a variance needs at least two masked entries")
    return masked_mean((values - masked_mean(values, mask)) ** 2, mask) * count / (count - 1)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Normalise to unit variance over loss tokens, so padding and tool tokens do not skew the statistics."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean


@dataclass(frozen=True)
class Totals:
    """What a mini-batch's loss divides by: its loss tokens and its rows.

    Given to ``agg_loss``, a micro-batch's loss is its part of the mini-batch's, and the parts add
    up to the same loss however the mini-batch is split into micro-batches and across data-parallel
    ranks (verl's global normalisation, ``batch_num_tokens`` / ``global_batch_size``).
    """

    tokens: float
    rows: float

    @classmethod
    def of(cls, response_mask: Tensor) -> Totals:
        return cls(float(response_mask.float().sum()), float(response_mask.shape[0]))


def agg_loss(
    loss_mat: Tensor, loss_mask: Tensor, mode: str, totals: Totals | None = None, scale: float | None = None
) -> Tensor:
    """Reduce per-token losses to a scalar; the mode decides how much long responses weigh.

    As verl's trainer aggregates: ``token-sum`` adds every loss token; the ``seq-mean-*`` modes
    average over all rows of the mini-batch (verl's ``global_batch_size``, its mini-batch's
    samples), a row without loss tokens adding 0; ``seq-mean-token-sum-norm`` divides that by
    ``scale`` (verl's ``loss_scale_factor``; None: the response width). With no loss token at all
    the loss is 0, never NaN. ``totals``: those of the whole mini-batch these rows are part of
    (their own by default).
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of: {', '.join(LOSS_AGG_MODES)}")
    totals = totals or Totals.of(loss_mask)
    mask = loss_mask.to(loss_mat.dtype)
    token_sums = (loss_mat * mask).sum(-1)
    if mode == "token-mean":
        return token_sums.sum() / max(totals.tokens, 1e-8)
    if mode == "token-sum":
        return token_sums.sum()
    if mode == "seq-mean-token-mean":
        token_sums = token_sums / (mask.sum(-1) + 1e-8)
    loss = token_sums.sum() / max(totals.rows, 1.0)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (scale if scale is not None else loss_mask.shape[-1])
    return loss


def token_share(values: Tensor, mask: Tensor, totals: Totals | None = None) -> float:
    """These rows' part of the mean of ``values`` over the mini-batch's loss tokens (a metric that,
    summed over micro-batches and ranks, is the mini-batch's mean)."""
    return float((values * mask.to(values.dtype)).sum() / max((totals or Totals.of(mask)).tokens, 1e-8))
