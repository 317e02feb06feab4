"""Rollout correction (verl's ``algorithm.rollout_correction``): importance weights, rejection
masks and off-policy metrics for samples the engine drew from other weights.

With an overlapped schedule the samples of a batch come from the rollout engines' weights, one
or more updates older than the policy being trained (and, even in ``sync``, engine numerics
differ a little from the trainer's). ``correct`` compares a policy's log-probs with the rollout's
(verl's ``compute_rollout_correction_and_rejection_mask``): in decoupled mode the recomputed old
log-probs, once per batch; in bypass mode the log-probs being trained, per micro-batch, inside
``bypass_mode`` (verl's ``compute_policy_loss_bypass_mode``). Every metric is verl's, by
its ``rollout_corr/*`` name.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from skip_plugin_trainer.algorithms.aggregation import masked_mean
from skip_plugin_trainer.algorithms.contract import LossContext, LossInputs, PolicyLoss
from skip_plugin_trainer.algorithms.losses import reinforce, vanilla
from skip_plugin_trainer.config.algorithm import RolloutCorrection

# verl's bound on a log-ratio before ``exp``: past exp(20) a weight is meaningless anyway.
SAFETY_BOUND = 20.0


def correct(
    correction: RolloutCorrection, log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor
) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """(IS weights or None, the response mask less the rejected tokens, ``rollout_corr/*`` metrics)."""
    valid = response_mask.bool()  # padding may hold any log-prob: none of it may reach a sum
    log_prob = torch.where(valid, log_prob.detach().float(), 0.0)
    rollout_log_prob = torch.where(valid, rollout_log_prob.float(), 0.0)
    weights, mask, metrics = None, response_mask, {}
    if not response_mask.any():  # verl refuses an empty batch; skip trains it unchanged (a 0 loss)
        return weights, mask, metrics
    bounds = correction.is_bounds()
    if bounds is not None:
        weights, metrics = rollout_is_weights(
            log_prob, rollout_log_prob, response_mask, level=correction.rollout_is, threshold=bounds[0],
            lower=bounds[1], batch_normalize=correction.rollout_is_batch_normalize,
        )  # fmt: skip
    if correction.rollout_rs is not None:
        mask, rs_metrics = rejection_mask(log_prob, rollout_log_prob, response_mask, correction.rs_bounds())
        metrics |= rs_metrics
    return weights, mask, metrics | offpolicy_metrics(log_prob, rollout_log_prob, response_mask)


def bypass_mode(inputs: LossInputs, ctx: LossContext) -> PolicyLoss:
    """The loss of bypass mode (verl's ``bypass_mode``), where ``inputs.old_log_prob`` are the
    rollout's. ``ppo_clip``: PPO's clipped loss, whose ratio is already policy / rollout, so IS
    weights would count it twice and are only measured. ``reinforce``: -A log pi, weighted by
    them when ``rollout_is`` is set. Either way the rejected tokens leave the loss (not the
    entropy or KL terms, as in verl); the metrics include the ``rollout_corr/*`` ones.

    The loss divides by the mini-batch's tokens or rows counted before any was rejected
    (``ctx.totals``), as verl's does: a rejected token adds 0 to the mean instead of leaving it,
    so the tokens kept weigh no more than they would have."""
    correction = ctx.correction
    if correction is None:
        raise ValueError("actor.policy_loss.loss_mode: bypass_mode needs algorithm.rollout_correction.bypass_mode=true")
    with torch.no_grad():
        weights, mask, metrics = correct(correction, inputs.log_prob, inputs.old_log_prob, inputs.response_mask)
    kept = replace(ctx, mask=mask)
    if correction.loss_type == "reinforce":
        result = reinforce(replace(inputs, response_mask=mask, weights=weights), kept)
    else:
        result = vanilla(replace(inputs, response_mask=mask, weights=None), kept)
    return PolicyLoss(result.loss, result.metrics | metrics)


def rollout_is_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    level: str,
    threshold: float,
    lower: float | None = None,
    batch_normalize: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """Importance weights old / rollout (0 on padding) and their metrics.

    ``token``: each token's own ratio. ``sequence``: the product over the response, the same for
    all its tokens. Truncation at ``threshold`` bounds the variance a rare token could add; with
    ``lower`` (IcePop) a weight outside [lower, threshold] is 0 instead. ``batch_normalize``
    divides by the batch's mean weight (per token, or per sequence for ``sequence``) after the
    metrics are taken, so the loss keeps its scale.
    """
    mask = response_mask.float()
    token_log_ratio = torch.where(mask.bool(), old_log_prob.float() - rollout_log_prob.float(), 0.0)
    if level == "token":
        log_ratio = token_log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask
    else:
        log_ratio = token_log_ratio.sum(-1, keepdim=True)
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(mask) * mask
    inside = (raw >= lower) & (raw <= threshold) if lower is not None else None
    weights = raw.clamp(max=threshold) if inside is None else torch.where(inside, raw, 0.0)
    metrics = _is_metrics(weights, raw, log_ratio, mask, level, threshold, lower)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            valid = (mask.sum(-1) > 0).float()
            mean = (masked_mean(weights, mask, dim=-1) * valid).sum() / valid.sum().clamp_min(1e-8)
        normalized = mean > 1e-8  # all weights zeroed (IcePop): nothing to scale
        weights = weights / mean if normalized else weights
        metrics["rollout_corr/rollout_is_batch_norm_factor"] = mean.item() if normalized else 1.0
    return weights.detach(), metrics


def _is_metrics(
    weights: Tensor, raw: Tensor, log_ratio: Tensor, mask: Tensor, level: str, upper: float, lower: float | None
) -> dict[str, float]:
    """verl's ``compute_is_metrics``: the applied weights' mean, spread and effective sample size,
    and the share of raw ratios beyond the bounds (a sequence's in log space, never overflowing)."""
    low = 1.0 / upper if lower is None else lower
    metrics = {"rollout_is_mean": masked_mean(weights, mask).item()}
    if level == "sequence":
        metrics["rollout_is_max"] = torch.exp(log_ratio.max().clamp(max=SAFETY_BOUND)).item()
        metrics["rollout_is_min"] = torch.exp(log_ratio.min()).item()
        metrics["rollout_is_ratio_fraction_high"] = (log_ratio > torch.tensor(upper).log()).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (log_ratio < torch.tensor(low).log()).float().mean().item()
    else:
        keep = mask.bool()
        metrics["rollout_is_max"] = weights[keep].max().item()
        metrics["rollout_is_min"] = weights[keep].min().item()
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask).item()
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((raw < low).float(), mask).item()
    bounded = weights.clamp(0.0, upper)
    mean = masked_mean(bounded, mask)
    variance = masked_mean(bounded.square(), mask) - mean.square()
    metrics["rollout_is_std"] = variance.clamp_min(0.0).sqrt().item() if mask.sum() > 1 else 0.0
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean((bounded / (mean + 1e-8)).square(), mask).item()
    seq = masked_mean(weights, mask, dim=-1)  # a sequence's mean weight (rows without tokens: 0)
    raw_seq = masked_mean(raw, mask, dim=-1)
    metrics |= {
        "rollout_is_seq_mean": seq.mean().item(),
        "rollout_is_seq_std": seq.std().item() if seq.numel() > 1 else 0.0,
        "rollout_is_seq_max": seq.max().item(),
        "rollout_is_seq_min": seq.min().item(),
        "rollout_is_seq_max_deviation": (seq - 1.0).abs().max().item(),
        "rollout_is_seq_fraction_high": (raw_seq > upper).float().mean().item(),
        "rollout_is_seq_fraction_low": (raw_seq < low).float().mean().item(),
    }
    if lower is not None:  # IcePop: the share of tokens whose weight was zeroed
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask).item()
    return {f"rollout_corr/{key}": value for key, value in metrics.items()}


def rejection_mask(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, bounds: dict[str, tuple[float | None, float]]
) -> tuple[Tensor, dict[str, float]]:
    """``response_mask`` less the tokens that fail any option's bounds (verl's
    ``compute_rollout_rejection_mask``), and the share each option and all of them rejected.

    ``bounds`` maps an option (``RolloutCorrection.rs_bounds``) to (lower, upper): a token option
    judges each token by its own divergence, a ``seq_*`` one a whole sequence by the sum, mean or
    max of its tokens'. A k1 statistic must lie in [log lower, log upper], k2 and k3 at most upper.
    """
    mask = response_mask.float()
    valid = mask.bool()
    log_ratio = (old_log_prob.float() - rollout_log_prob.float()).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -log_ratio, "k2": 0.5 * log_ratio.square(), "k3": log_ratio.exp() - 1.0 - log_ratio}
    keep_all = torch.ones_like(mask)
    seq_valid = valid.any(-1)
    metrics = {}
    for option, (lower, upper) in bounds.items():
        level, kind = option.rsplit("_", 1)
        stat = torch.where(valid, per_token[kind], 0.0)
        if level == "seq_sum":
            stat = stat.sum(-1, keepdim=True)
        elif level == "seq_mean":
            stat = masked_mean(stat, mask, dim=-1).unsqueeze(-1)
        elif level == "seq_max":  # a sequence without tokens has max 0, as in verl
            stat = torch.where(valid, per_token[kind], -torch.inf).amax(-1, keepdim=True)
            stat = torch.where(seq_valid.unsqueeze(-1), stat, 0.0)
        # k1 is kept in [log lower, log upper], k2 and k3 at most upper (verl's bounds, and its metrics').
        low, high = (math.log(lower), math.log(upper)) if kind == "k1" else (None, upper)
        keep = (stat <= high) & (stat >= low) if low is not None else stat <= high
        keep, stat = keep.expand_as(mask), stat.expand_as(mask)
        keep_all = keep_all * keep.float()
        metrics |= _rs_metrics(option, stat, keep, mask, level == "token", low, high)
    metrics["rollout_rs_masked_fraction"] = masked_mean(1.0 - keep_all, mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = ((keep_all < 0.5) & valid).any(-1).float().mean().item()
    kept = (response_mask * keep_all).to(response_mask.dtype)
    return kept, {f"rollout_corr/{key}": value for key, value in metrics.items()}


def _rs_metrics(
    option: str, stat: Tensor, keep: Tensor, mask: Tensor, per_token: bool, low: float | None, high: float
) -> dict[str, float]:
    """verl's ``compute_rs_metrics`` of one option: its statistic's mean, range, spread and the shares
    beyond the bounds (per token, or per sequence for a ``seq_*`` option), and what it rejected."""
    valid, seq_valid = mask.bool(), mask.bool().any(-1)
    seq = (masked_mean(stat, mask, dim=-1) if per_token else stat[:, 0])[seq_valid]  # one value a sequence
    values = stat[valid] if per_token else seq
    bounded = stat.clamp(low if low is not None else 0.0, high)
    variance = masked_mean(bounded.square(), mask) - masked_mean(bounded, mask).square()
    metrics = {
        "mean": masked_mean(stat, mask).item(),
        "max": values.max().item(),
        "min": values.min().item(),
        "fraction_high": (values > high).float().mean().item(),
        "fraction_low": (values < low).float().mean().item() if low is not None else 0.0,
        "std": variance.clamp_min(0.0).sqrt().item() if mask.sum() > 1 else 0.0,
        "seq_mean": seq.mean().item(),
        "seq_std": seq.std().item() if seq.numel() > 1 else 0.0,
        "seq_max": seq.max().item(),
        "seq_min": seq.min().item(),
        "seq_max_deviation": seq.abs().max().item(),
        "seq_fraction_high": (seq > high).float().mean().item(),
        "masked_fraction": masked_mean(1.0 - keep.float(), mask).item(),
        "seq_masked_fraction": (~keep & valid).any(-1)[seq_valid].float().mean().item(),
    }
    if low is not None:
        metrics["seq_fraction_low"] = (seq < low).float().mean().item()
    return {f"rollout_rs_{option}_{key}": value for key, value in metrics.items()}


def offpolicy_metrics(log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> dict[str, float]:
    """How far the rollout's policy is from the trainer's (verl's ``compute_offpolicy_metrics``):
    KL(rollout || policy) two ways, both perplexities and their gap, and the chi-square divergence
    per token and per sequence (the variance of the importance weights)."""
    mask = response_mask.float()
    log_prob = torch.where(mask.bool(), log_prob.float(), 0.0)
    rollout_log_prob = torch.where(mask.bool(), rollout_log_prob.float(), 0.0)
    log_ratio = log_prob - rollout_log_prob
    bounded = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # verl's k3 is unbounded; inf helps no one
    mean_log_prob = masked_mean(log_prob, mask, dim=-1)
    mean_rollout_log_prob = masked_mean(rollout_log_prob, mask, dim=-1)
    log_ppl_diff = mean_rollout_log_prob - mean_log_prob
    seq_log_ratio = log_ratio.sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    metrics = {
        "training_ppl": torch.exp(-mean_log_prob).mean(),
        "training_log_ppl": (-mean_log_prob).mean(),
        "kl": masked_mean(-log_ratio, mask),
        "k3_kl": masked_mean(bounded.exp() - bounded - 1.0, mask),
        "rollout_ppl": torch.exp(-mean_rollout_log_prob).mean(),
        "rollout_log_ppl": (-mean_rollout_log_prob).mean(),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(),
        "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": log_ppl_diff.exp().mean(),
        "chi2_token": masked_mean(bounded.exp().square(), mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * seq_log_ratio).mean() - 1.0,
    }
    return {f"rollout_corr/{key}": value.item() for key, value in metrics.items()}
