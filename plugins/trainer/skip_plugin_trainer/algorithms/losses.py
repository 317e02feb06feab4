"""verl 0.9.1's policy losses (``core_algos.py``, ``@register_policy_loss``), by its names.

Each takes a micro-batch (``LossInputs``) and the actor's settings with the mini-batch's totals
(``LossContext``) and returns the loss with verl's metrics. Every one is checked against verl's
own function on the same tensors (``plugins/verl/tests/in_verl/test_algorithms.py``): loss,
gradient and metrics. The clip bounds are ``actor.clip_ratio_low`` / ``clip_ratio_high``
(``actor.clip_ratio`` gives both); the rollout correction's weights, when set, scale each
token's loss. The covariance losses are in ``cov_losses.py``, bypass mode in ``correction.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from skip_plugin_trainer.algorithms.contract import LossContext, LossInputs, PolicyLoss

# verl's bound on a log-ratio before ``exp``: past exp(20) a ratio is meaningless anyway.
LOG_RATIO_BOUND = 20.0


def _log_ratio(inputs: LossInputs, clamp: bool = True) -> Tensor:
    log_ratio = inputs.log_prob.float() - inputs.old_log_prob.float()
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND) if clamp else log_ratio


def _metrics(ctx: LossContext, log_ratio: Tensor, clipped: Tensor | None, lower: Tensor | None) -> dict[str, float]:
    metrics = {"actor/ppo_kl": ctx.mean(-log_ratio)}
    if clipped is not None:
        metrics["actor/pg_clipfrac"] = ctx.mean(clipped.float())
    if lower is not None:
        metrics["actor/pg_clipfrac_lower"] = ctx.mean(lower.float())
    return metrics


def vanilla(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """PPO's clipped surrogate, which stops one batch from moving the policy far from the sampler.

    The dual clip (``clip_ratio_c``; null: none) bounds the loss of negative-advantage tokens
    whose ratio exploded, since an unbounded term there would dominate the batch."""
    actor, advantages = ctx.actor, inputs.advantages.float()
    log_ratio = _log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - actor.clip_ratio_low, 1 + actor.clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    lower = torch.zeros_like(losses, dtype=torch.bool)
    if actor.clip_ratio_c is not None:
        bound = -advantages * actor.clip_ratio_c
        lower = (losses > bound) & (advantages < 0)
        losses = torch.where(advantages < 0, torch.minimum(losses, bound), losses)
    loss = ctx.agg(inputs.weighted(losses))
    return PolicyLoss(loss, _metrics(ctx, log_ratio, clipped > unclipped, lower))


def _dppo(inputs: LossInputs, ctx: LossContext, valid_positive: Tensor, valid_negative: Tensor) -> PolicyLoss:
    """DPPO's shape: the truncated ratio (at ``clip_ratio_c``, detached) times -A log pi, on the
    tokens whose divergence from the old policy stays inside the bounds for their advantage's sign."""
    advantages, log_prob = inputs.advantages.float(), inputs.log_prob.float()
    log_ratio = _log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    truncate = ctx.actor.clip_ratio_c if ctx.actor.clip_ratio_c is not None else float("inf")
    truncated = ratio.clamp(max=truncate).detach()
    valid = torch.where(advantages > 0, valid_positive, valid_negative).detach().float()
    losses = -advantages * truncated * log_prob * valid
    loss = ctx.agg(inputs.weighted(losses))
    return PolicyLoss(loss, _metrics(ctx, log_ratio, 1.0 - valid, (ratio > truncate).float() * valid))


def dppo_tv(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """DPPO with the total-variation bound: a token's probability may move up by at most
    ``clip_ratio_high`` (positive advantage) or down by ``clip_ratio_low`` (negative)."""
    prob, old_prob = torch.exp(inputs.log_prob.float()), torch.exp(inputs.old_log_prob.float())
    change = prob - old_prob
    return _dppo(inputs, ctx, change <= ctx.actor.clip_ratio_high, change >= -ctx.actor.clip_ratio_low)


def dppo_kl(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """DPPO with the binary-KL bound between the old and new probability of each token."""
    log_prob, old_log_prob = inputs.log_prob.float(), inputs.old_log_prob.float()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    positive = (binary_kl <= ctx.actor.clip_ratio_high) | (prob <= old_prob)
    negative = (binary_kl <= ctx.actor.clip_ratio_low) | (prob >= old_prob)
    return _dppo(inputs, ctx, positive, negative)


def gspo(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """GSPO: one importance ratio per sequence (the geometric mean of its tokens'), clipped, with
    each token's gradient flowing through its own log-prob. verl's scripts pair it with
    ``loss_agg_mode=seq-mean-token-mean``."""
    actor, mask = ctx.actor, inputs.response_mask.float()
    log_prob, advantages = inputs.log_prob.float(), inputs.advantages.float()
    log_ratio = log_prob - inputs.old_log_prob.float()
    sequence = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_seq_ratio = (log_prob - log_prob.detach() + sequence.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = torch.exp(log_seq_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - actor.clip_ratio_low, 1 + actor.clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    loss = ctx.agg(inputs.weighted(losses))
    return PolicyLoss(loss, _metrics(ctx, log_ratio, clipped > unclipped, torch.zeros_like(mask)))


def sapo(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """SAPO: a smooth sigmoid gate on the ratio in place of the clip, its temperature
    ``actor.tau_pos`` for positive advantages and ``actor.tau_neg`` otherwise; always aggregated
    as ``seq-mean-token-mean``, as verl does whatever ``loss_agg_mode`` says."""
    advantages = inputs.advantages.float()
    log_ratio = _log_ratio(inputs)
    taus = torch.where(advantages > 0, ctx.actor.tau_pos, ctx.actor.tau_neg)
    gates = torch.sigmoid(taus * (torch.exp(log_ratio) - 1.0)) * (4.0 / taus)
    loss = ctx.agg(inputs.weighted(-gates * advantages), mode="seq-mean-token-mean")
    zero = torch.zeros_like(advantages)
    return PolicyLoss(loss, _metrics(ctx, log_ratio, zero, zero))


def gpg(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """GPG: the plain policy gradient -A log pi, no ratio and no clip (verl reports no metric)."""
    losses = -inputs.log_prob.float() * inputs.advantages.float()
    return PolicyLoss(ctx.agg(inputs.weighted(losses)))


def geo_mean(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """GMPO: the geometric mean of each sequence's clipped token ratios times its mean advantage,
    averaged over the mini-batch's sequences (verl's ``torch.mean``, whatever ``loss_agg_mode``)."""
    actor, mask = ctx.actor, inputs.response_mask.float()
    advantages = inputs.advantages.float()
    log_ratio = inputs.log_prob.float() - inputs.old_log_prob.float()
    sign = torch.sign(advantages)
    bounded = log_ratio.clamp(-actor.clip_ratio_low, actor.clip_ratio_high)
    kept = sign * torch.min(sign * log_ratio, sign * bounded)
    lengths = mask.sum(-1) + 1e-8
    ratio = torch.exp((kept * mask).sum(-1) / lengths)
    losses = -((advantages * mask).sum(-1) / lengths) * ratio
    if inputs.weights is not None:
        losses = losses * torch.exp((torch.log(inputs.weights.float() + 1e-10) * mask).sum(-1) / lengths)
    loss = losses.sum() / max(ctx.totals.rows, 1.0)
    clipped = log_ratio != bounded
    return PolicyLoss(loss, _metrics(ctx, log_ratio, clipped & (advantages > 0), clipped & (advantages < 0)))


def dro(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """DRO: -A log pi with a quadratic penalty on the log-ratio, ``policy_loss.dro_beta`` / 2 x it."""
    beta = ctx.actor.policy_loss.dro_beta
    if beta is None or beta <= 0:  # the settings refuse it first; a plugin's caller may not
        raise ValueError("actor.policy_loss.dro_beta: DRO needs a positive value")
    log_prob = inputs.log_prob.float()
    log_ratio = log_prob - inputs.old_log_prob.float()
    losses = -(log_prob * inputs.advantages.float() - 0.5 * beta * log_ratio.square())
    return PolicyLoss(ctx.agg(inputs.weighted(losses)), _metrics(ctx, log_ratio, None, None))


def cispo(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """CISPO: -A log pi weighted by the clipped ratio, detached, so clipped tokens still pass
    their gradient (scaled) instead of dropping it as PPO's clip does."""
    actor, advantages = ctx.actor, inputs.advantages.float()
    log_ratio = _log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - actor.clip_ratio_low, 1 + actor.clip_ratio_high)
    losses = -clipped.detach() * advantages * inputs.log_prob.float()
    loss = ctx.agg(inputs.weighted(losses))
    return PolicyLoss(loss, _metrics(ctx, log_ratio, ratio != clipped, torch.zeros_like(ratio)))


def reinforce(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """The plain policy gradient -A log pi (verl's ``compute_policy_loss_reinforce``, bypass mode's
    ``loss_type=reinforce``), ``old_log_prob`` being the rollout's: off-policy samples are corrected
    only by the weights. ``actor/ppo_kl`` is the one to the rollout's policy, as verl's."""
    losses = -inputs.advantages.float() * inputs.log_prob.float()
    return PolicyLoss(ctx.agg(inputs.weighted(losses)), _metrics(ctx, _log_ratio(inputs, clamp=False), None, None))
