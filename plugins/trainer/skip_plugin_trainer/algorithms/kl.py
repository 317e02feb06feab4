"""KL penalties between the policy and the reference, from the sampled tokens' log-probs alone
(verl's ``kl_penalty``): in the loss (``actor.kl_loss_type``) or folded into the reward
(``algorithm.kl_penalty``)."""

from __future__ import annotations

from torch import Tensor

from skip_plugin_trainer.algorithms.aggregation import masked_mean

KL_PENALTIES: tuple[str, ...] = ("kl", "abs", "mse", "low_var_kl")
_KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, mode: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs alone.

    ``low_var_kl`` (k3) is non-negative and low-variance; its log-ratio is clamped first so ``exp`` cannot
    overflow, which changes nothing since any value that large is clamped to 10 anyway.
    """
    if mode not in KL_PENALTIES + tuple(_KL_ALIASES):
        raise ValueError(
            f"unknown KL penalty {mode!r}; expected one of: {', '.join(KL_PENALTIES + tuple(_KL_ALIASES))}"
        )
    mode = _KL_ALIASES.get(mode, mode)
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
