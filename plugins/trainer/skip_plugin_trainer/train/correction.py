"""Rollout correction: importance weights for samples the engine drew from other weights.

With an overlapped schedule the samples of a batch come from the rollout engines' weights, one
or more updates older than the policy being trained (and, even in ``sync``, engine numerics
differ a little from the trainer's). PPO's ratio is taken against old log-probs; when those are
recomputed by the trainer, the truncated importance weight old / rollout reweights each token
so that the gradient stays that of the trainer's policy (verl's ``rollout_is``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from skip_plugin_trainer.train.algorithm import masked_mean


def rollout_is_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    level: Literal["token", "sequence"],
    threshold: float,
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance weights (0 on padding) and their ``rollout_corr/*`` metrics.

    ``token``: each token's own ratio. ``sequence``: the product over the response, the same for
    all its tokens. Truncation at ``threshold`` bounds the variance a rare token could add.
    """
    mask = response_mask.bool()
    token_log_ratio = (old_log_prob.float() - rollout_log_prob.float()).masked_fill(~mask, 0.0)
    log_ratio = token_log_ratio
    if level == "sequence":
        log_ratio = token_log_ratio.sum(dim=-1, keepdim=True).expand_as(token_log_ratio)
    raw = torch.exp(log_ratio.clamp(-20, 20))
    weights = raw.clamp(max=threshold).masked_fill(~mask, 0.0)
    mask_f = mask.float()
    metrics = {
        "rollout_corr/log_ratio_mean": masked_mean(token_log_ratio, mask_f).item(),
        "rollout_corr/rollout_is_mean": masked_mean(raw, mask_f).item(),
        "rollout_corr/rollout_is_max": raw[mask].max().item() if mask.any() else 0.0,
        "rollout_corr/rollout_is_min": raw[mask].min().item() if mask.any() else 0.0,
        "rollout_corr/rollout_is_truncated_frac": masked_mean((raw > threshold).float(), mask_f).item(),
    }
    return weights.detach(), metrics
