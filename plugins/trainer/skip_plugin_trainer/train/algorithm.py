"""The RL math of the GRPO/PPO trainer: advantage estimators, loss aggregation, the clipped policy loss,
KL penalties and log-prob/entropy from logits, with verl's semantics. Every function is pure: it reads
tensors shaped ``[batch, response_len]`` (logits add a vocabulary axis) and returns new ones, so it can be
tested on hand-sized examples and reused by any backend. ``response_mask`` is 1 on tokens the policy
sampled and 0 on padding and tool responses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce_plus_plus")
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_PENALTIES: tuple[str, ...] = ("kl", "abs", "mse", "low_var_kl")
_KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def _check(name: str, allowed: Sequence[str], what: str) -> str:
    """Fail early with the valid choices, since these names usually come from a user's config."""
    if name not in allowed:
        raise ValueError(f"unknown {what} {name!r}; expected one of: {', '.join(allowed)}")
    return name


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Average over loss tokens only; an empty mask gives 0 rather than NaN so empty batches stay finite."""
    mask = mask.to(values.dtype)
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp_min(1e-8)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Normalise to unit variance over loss tokens, so padding and tool tokens do not skew the statistics.

    The variance is unbiased, as in verl, which needs at least two loss tokens.
    """
    mask = mask.to(values.dtype)
    count = mask.sum()
    if count < 2:
        raise ValueError("whitening needs at least two masked entries")
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask) * count / (count - 1)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    return whitened if shift_mean else whitened + mean


def _group_ids(index: np.ndarray | Sequence[str], batch_size: int, device: torch.device) -> tuple[Tensor, int]:
    """Dense group numbers let one scatter pass compute the statistics of every group at once."""
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} entries for {batch_size} rows")
    numbers: dict = {}
    ids = [numbers.setdefault(uid, len(numbers)) for uid in index]
    return torch.tensor(ids, dtype=torch.long, device=device), len(numbers)


def _group_sum(values: Tensor, group: Tensor, n_groups: int) -> Tensor:
    """Each row's group total, broadcast back to the row, so group baselines stay vectorised."""
    return values.new_zeros(n_groups).index_add_(0, group, values)[group]


def _sequence_scores(token_level_rewards: Tensor, index: np.ndarray | Sequence[str]) -> tuple[Tensor, Tensor, int]:
    """Outcome estimators judge whole responses, so they start from each row's summed reward and its group."""
    scores = token_level_rewards.float().sum(-1)
    group, n_groups = _group_ids(index, scores.shape[0], scores.device)
    return scores, group, n_groups


def grpo_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | Sequence[str],
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Score each response against the other samples of its prompt, so no value model is needed.

    A group of one has no peers to compare with: it keeps its raw score (mean 0, std 1), as in verl.
    """
    scores, group, n_groups = _sequence_scores(token_level_rewards, index)
    count = _group_sum(torch.ones_like(scores), group, n_groups)
    mean = _group_sum(scores, group, n_groups) / count
    std = torch.sqrt(_group_sum((scores - mean) ** 2, group, n_groups) / (count - 1).clamp_min(1))
    singleton = count == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    centred = scores - mean
    advantages = (centred / (std + epsilon) if norm_by_std else centred).unsqueeze(-1) * response_mask
    return advantages, advantages


def rloo_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, index: np.ndarray | Sequence[str]
) -> tuple[Tensor, Tensor]:
    """Baseline each response with the mean of its peers, which keeps the estimate unbiased.

    A group of one has no peers: its group total minus its own score is exactly 0, so the baseline is 0.
    """
    scores, group, n_groups = _sequence_scores(token_level_rewards, index)
    count = _group_sum(torch.ones_like(scores), group, n_groups)
    baseline = (_group_sum(scores, group, n_groups) - scores) / (count - 1).clamp_min(1)
    advantages = (scores - baseline).unsqueeze(-1) * response_mask
    return advantages, advantages


def reinforce_plus_plus_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, gamma: float
) -> tuple[Tensor, Tensor]:
    """Discounted per-token returns, whitened over the batch in place of a learned critic.

    As in verl, the running return is cut where the mask is 0, so a loss token before a tool response
    does not see rewards after it. Returns are zeroed off the mask to match the other estimators.
    """
    rewards = token_level_rewards.float()
    mask = response_mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return masked_whiten(returns, mask) * mask, returns * mask


def compute_advantages(
    estimator: str,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | Sequence[str],
    *,
    gamma: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """One entry point so the trainer picks the estimator by its config name; returns (advantages, returns)."""
    _check(estimator, ADVANTAGE_ESTIMATORS, "advantage estimator")
    if estimator == "grpo":
        return grpo_advantages(token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo, epsilon)
    if estimator == "rloo":
        return rloo_advantages(token_level_rewards, response_mask, index)
    return reinforce_plus_plus_advantages(token_level_rewards, response_mask, gamma)


@dataclass(frozen=True)
class Totals:
    """What a mini-batch's loss divides by: its loss tokens, its rows, and its rows with a loss token.

    Given to ``agg_loss``, a micro-batch's loss is its part of the mini-batch's, and the parts add
    up to the same loss however the mini-batch is split into micro-batches and across data-parallel
    ranks (verl's global normalisation, ``batch_num_tokens`` / ``global_batch_size``).
    """

    tokens: float
    rows: float
    rows_with_tokens: float

    @classmethod
    def of(cls, response_mask: Tensor) -> Totals:
        tokens = response_mask.float().sum(-1)
        return cls(float(tokens.sum()), float(len(tokens)), float((tokens > 0).sum()))


def agg_loss(loss_mat: Tensor, loss_mask: Tensor, mode: str, totals: Totals | None = None) -> Tensor:
    """Reduce per-token losses to a scalar; the mode decides how much long responses weigh.

    ``seq-mean-token-sum`` averages over all rows, as verl does, so a row without loss tokens adds 0 and
    still counts. ``seq-mean-token-mean`` averages only over rows with at least one loss token, since an
    empty row has no mean; with none at all the loss is 0, never NaN. ``totals``: those of the whole
    mini-batch these rows are part of (their own by default).
    """
    _check(mode, LOSS_AGG_MODES, "loss aggregation mode")
    totals = totals or Totals.of(loss_mask)
    mask = loss_mask.to(loss_mat.dtype)
    token_sums = (loss_mat * mask).sum(-1)
    if mode == "token-mean":
        return token_sums.sum() / max(totals.tokens, 1e-8)
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / max(totals.rows, 1.0)
    sequence_means = token_sums / mask.sum(-1).clamp_min(1)
    return sequence_means.sum() / max(totals.rows_with_tokens, 1.0)


def token_share(values: Tensor, mask: Tensor, totals: Totals | None = None) -> float:
    """These rows' part of the mean of ``values`` over the mini-batch's loss tokens (a metric that,
    summed over micro-batches and ranks, is the mini-batch's mean)."""
    return float((values * mask.to(values.dtype)).sum() / max((totals or Totals.of(mask)).tokens, 1e-8))


@dataclass(frozen=True)
class PolicyLoss:
    """The loss to backpropagate and the two health metrics PPO runs are watched by (a loss that
    clips nothing has no ``clipfrac``)."""

    loss: Tensor
    clipfrac: float | None
    approx_kl: float


def policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    weights: Tensor | None = None,
    totals: Totals | None = None,
) -> PolicyLoss:
    """PPO's clipped surrogate, which stops one batch from moving the policy far from the sampler.

    The dual clip bounds the loss of negative-advantage tokens whose ratio exploded, since an unbounded
    term there would dominate the batch. The log-ratio is clamped so ``exp`` cannot overflow.
    ``weights`` scale each token's loss (rollout-correction importance weights). With ``totals``
    the loss and the metrics are these rows' parts of their mini-batch's (``Totals``).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"clip_ratio_c must be greater than 1, got {clip_ratio_c}")
    log_ratio = log_prob.float() - old_log_prob.float()
    ratio = torch.exp(log_ratio.clamp(-20, 20))
    advantages = advantages.float()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    if clip_ratio_c is not None:
        losses = torch.where(advantages < 0, torch.minimum(losses, -advantages * clip_ratio_c), losses)
    if weights is not None:
        losses = losses * weights.float()
    with torch.no_grad():
        clipfrac = token_share((clipped > unclipped).float(), response_mask, totals)
        approx_kl = token_share(-log_ratio, response_mask, totals)
    return PolicyLoss(agg_loss(losses, response_mask, loss_agg_mode, totals), clipfrac, approx_kl)


def reinforce_loss(
    log_prob: Tensor,
    rollout_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    weights: Tensor | None = None,
    totals: Totals | None = None,
) -> PolicyLoss:
    """The plain policy gradient -A log pi (verl's ``compute_policy_loss_reinforce``, bypass mode's
    ``loss_type=reinforce``): no ratio and no clip, so off-policy samples are corrected only by
    ``weights`` (detached importance weights pi / pi_rollout), which scale each token's loss.
    ``approx_kl`` is the one to the rollout's policy, as verl's ``actor/ppo_kl`` there."""
    losses = -advantages.float() * log_prob.float()
    if weights is not None:
        losses = losses * weights.float()
    with torch.no_grad():
        approx_kl = token_share(rollout_log_prob.float() - log_prob.float(), response_mask, totals)
    return PolicyLoss(agg_loss(losses, response_mask, loss_agg_mode, totals), None, approx_kl)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, mode: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs alone.

    ``low_var_kl`` (k3) is non-negative and low-variance; its log-ratio is clamped first so ``exp`` cannot
    overflow, which changes nothing since any value that large is clamped to 10 anyway.
    """
    mode = _KL_ALIASES.get(_check(mode, KL_PENALTIES + tuple(_KL_ALIASES), "KL penalty"), mode)
    diff = log_prob.float() - ref_log_prob.float()
    if mode == "kl":
        return diff
    if mode == "abs":
        return diff.abs()
    if mode == "mse":
        return 0.5 * diff.square()
    log_ratio = (-diff).clamp(-20, 20)
    return (log_ratio.exp() - log_ratio - 1).clamp(-10, 10)


def apply_kl_penalty(
    token_level_scores: Tensor,
    response_mask: Tensor,
    log_prob: Tensor,
    ref_log_prob: Tensor,
    *,
    coef: float,
    mode: str,
) -> tuple[Tensor, float]:
    """Fold the KL to the reference into the reward, so drift is paid for where it happens.

    Returns the penalised rewards and the batch's KL (the mean over sequences of each one's token mean).
    """
    mask = response_mask.float()
    kl = kl_penalty(log_prob, ref_log_prob, mode) * mask
    rewards = token_level_scores.float() - coef * kl
    return rewards, masked_mean(kl, mask, dim=-1).mean().item()


def log_probs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-prob of each label, via logsumexp so the full log-softmax over the vocabulary is never stored."""
    logits = logits.float()
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-position entropy written as logsumexp minus the expected logit, which stays finite for large logits."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)
