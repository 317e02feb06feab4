"""verl's two covariance losses (Clip-Cov and KL-Cov, from "The Entropy Mechanism of RL for
Reasoning LMs"): PPO's loss, changed on the few tokens whose advantage and log-prob covary most,
which are the ones that collapse the entropy. The tokens are chosen within each micro-batch, as
verl chooses them; Clip-Cov draws among its candidates from torch's global generator, as verl does.
"""

from __future__ import annotations

import torch

from skip_plugin_trainer.algorithms.aggregation import masked_mean
from skip_plugin_trainer.algorithms.contract import LossContext, LossInputs, PolicyLoss


def clip_cov(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """PPO's clipped loss, whose gradient is dropped on ``policy_loss.clip_cov_ratio`` of the loss
    tokens, drawn among those PPO left unclipped whose covariance lies in
    (``clip_cov_lb``, ``clip_cov_ub``)."""
    actor, options = ctx.actor, ctx.actor.policy_loss
    mask, advantages = inputs.response_mask, inputs.advantages.float()
    log_prob = inputs.log_prob.float()
    log_ratio = log_prob - inputs.old_log_prob.float()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - actor.clip_ratio_low, 1 + actor.clip_ratio_high)
    clipped_by_ppo = (clipped > unclipped) & (mask > 0)
    cov = (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob.detach(), mask))
    cov[mask == 0] = -torch.inf
    cov[clipped_by_ppo] = -torch.inf
    count = max(int(options.clip_cov_ratio * mask.sum().item()), 1)
    candidates = torch.nonzero((cov < options.clip_cov_ub) & (cov > options.clip_cov_lb) & (mask > 0))
    if len(candidates) > 0:
        candidates = candidates[torch.randperm(len(candidates))[: min(count, len(candidates))]]
    keep = torch.ones_like(advantages)
    keep[candidates[:, 0], candidates[:, 1]] = 0
    losses = torch.maximum(unclipped, clipped) * keep
    loss = ctx.agg(inputs.weighted(losses))
    return PolicyLoss(loss, {"actor/pg_clipfrac": ctx.mean((keep == 0).float()), "actor/ppo_kl": ctx.mean(-log_ratio)})


def kl_cov(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """The unclipped policy gradient, plus ``policy_loss.ppo_kl_coef`` x |log-ratio| on the
    ``policy_loss.kl_cov_ratio`` of loss tokens with the largest covariance. ``actor/ppo_kl`` is
    the mean |log-ratio|, as verl's."""
    options, advantages = ctx.actor.policy_loss, inputs.advantages.float()
    log_prob = inputs.log_prob.float()
    log_ratio = log_prob - inputs.old_log_prob.float()
    ratio = torch.exp(log_ratio)
    losses = -advantages * ratio
    penalised = losses + options.ppo_kl_coef * log_ratio.abs()
    valid = inputs.response_mask > 0
    positions = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    if len(positions):
        valid_advantages = advantages[valid].detach().reshape(-1).cpu()
        valid_log_probs = log_prob[valid].detach().reshape(-1).cpu()
        cov = (valid_advantages - valid_advantages.mean()) * (valid_log_probs - valid_log_probs.mean())
        top = torch.topk(cov, max(1, int(len(cov) * options.kl_cov_ratio)), largest=True).indices
        chosen = positions[top.to(positions.device)]
        width = advantages.shape[1]
        losses = losses.clone()
        losses[chosen // width, chosen % width] = penalised[chosen // width, chosen % width]
    loss = ctx.agg(inputs.weighted(losses))
    return PolicyLoss(loss, {"actor/ppo_kl": ctx.mean(log_ratio.abs())})
