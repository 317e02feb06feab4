"""The critic's math, with verl's semantics: the clipped value loss and the value metrics of a
step (GAE itself is an advantage estimator: ``algorithms/token_advantages.py``). Pure functions
over ``[batch, response_len]`` tensors; ``values[:, t]`` is the critic's estimate before response
token ``t``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from skip_plugin_trainer.algorithms.aggregation import Totals, agg_loss, token_share


@dataclass(frozen=True)
class ValueLoss:
    loss: Tensor
    clipfrac: float


def value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
    totals: Totals | None = None,
) -> ValueLoss:
    """PPO's clipped value loss: a new prediction may move at most ``cliprange_value`` from the
    value the advantages were computed with, unless that moves it further from the return. With
    ``totals``, these rows' parts of their mini-batch's loss and clip fraction (``Totals``)."""
    # Clamped between bounds, as verl does: inside them it is vpreds exactly. values + (vpreds -
    # values) differs from vpreds by a rounding where the two differ in sign or magnitude, and
    # counted such tokens as clipped.
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_loss, clipped_loss = (vpreds - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped_loss, clipped_loss), response_mask, loss_agg_mode, totals)
    clipfrac = token_share((clipped_loss > unclipped_loss).float(), response_mask, totals)
    return ValueLoss(loss, clipfrac)


def value_metrics(values: Tensor, returns: Tensor, response_mask: Tensor) -> dict[str, float]:
    """verl's ``critic/values/*``, ``critic/returns/*`` and ``critic/vf_explained_var`` over the
    loss tokens: how much of the returns' variance the critic's values account for."""
    valid = response_mask.bool()
    v, r = values.float()[valid], returns.float()[valid]
    if v.numel() == 0:
        return {}
    explained = 1.0 - torch.var(r - v, unbiased=False) / (torch.var(r, unbiased=False) + 1e-5)
    metrics = {"critic/vf_explained_var": explained.item()}
    for name, tensor in (("values", v), ("returns", r)):
        metrics |= {f"critic/{name}/mean": tensor.mean().item(), f"critic/{name}/max": tensor.max().item()}
        metrics[f"critic/{name}/min"] = tensor.min().item()
    return metrics
