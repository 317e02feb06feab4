"""verl 0.9.1's token-level advantage estimators, where a response's tokens get different
advantages: GAE (with a critic's values), REINFORCE++ (discounted returns, whitened over the
batch) and the optimal token baseline (OTB), by position (``optimal_token_baseline``) or by
count of the policy's own tokens, tool responses skipped (``tir_optimal_token_baseline``).

Each returns ``(advantages, returns)``, ``[batch, response_len]``, 0 off the mask (verl leaves
GAE's, and OTB's returns, nonzero there, where nothing reads them). A token off the mask inside
a response (a tool's output) is not a step of the policy: the running estimates carry across it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from skip_plugin_trainer.algorithms.aggregation import masked_whiten
from skip_plugin_trainer.algorithms.contract import AdvantageInputs
from skip_plugin_trainer.algorithms.groups import Groups
from skip_plugin_trainer.config.algorithm import AlgorithmConfig

OTB_EPSILON = 1e-8  # verl's, for a time step no response of the group reaches


def needed(inputs: AdvantageInputs, name: str, estimator: str) -> Tensor:
    """``inputs.<name>``, which the trainer provides when the estimator's ``needs`` names it."""
    value = getattr(inputs, name)
    if value is None:
        raise ValueError(f"{estimator} needs {name}, which the trainer did not provide")
    return value


def gae(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) with ``gamma`` and ``lam``: the
    advantages whitened over the batch's loss tokens, and returns = advantages + values before
    whitening (the critic's target). ``values[:, t]`` is the critic's estimate before token t."""
    values = needed(inputs, "values", "gae")
    rewards = inputs.token_level_rewards
    mask = inputs.response_mask.to(rewards.dtype)
    next_value = running = rewards.new_zeros(rewards.shape[0])
    columns = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + config.gamma * next_value - values[:, t]
        estimate = delta + config.gamma * config.lam * running
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        running = estimate * mask[:, t] + (1 - mask[:, t]) * running
        columns.append(running)
    advantages = torch.stack(columns[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, mask) * mask, returns * mask


def reinforce_plus_plus(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """REINFORCE++: each loss token's discounted reward-to-go (``gamma``), whitened over the
    batch's loss tokens in place of a critic. A reward on a token off the mask is dropped, and
    the running return crosses it unchanged (verl 0.9.1's; older verl cut it there)."""
    rewards = inputs.token_level_rewards
    mask = inputs.response_mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        step = rewards[:, t] + config.gamma * running
        returns[:, t] = step * mask[:, t]
        running = step * mask[:, t] + running * (1 - mask[:, t])
    return masked_whiten(returns, mask) * mask, returns


def _reward_to_go(rewards: Tensor, mask: Tensor) -> Tensor:
    return (rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])


def _path_variance(inputs: AdvantageInputs, mask: Tensor, estimator: str) -> Tensor:
    """W_t: the sum over loss tokens up to t of 1 - 2 pi_j + sum(pi^2), the squared norm of the
    log-prob's gradient with respect to the logits, so a baseline leans on the rows whose
    gradient so far is largest. With rollout importance weights rho, each term is scaled by
    rho^2 (what minimises the variance of the truncated-IS gradient)."""
    pi = torch.exp(needed(inputs, "old_log_probs", estimator))
    per_token = 1 - 2 * pi + needed(inputs, "sum_pi_squared", estimator)
    if inputs.rollout_is_weights is not None:
        per_token = per_token * (inputs.rollout_is_weights**2)
    return (per_token * mask).cumsum(dim=-1)


def _token_baselines(returns: Tensor, weights: Tensor, valid: Tensor, lengths: Tensor, groups: Groups) -> Tensor:
    """Per row and step t, B_t = sum G_t W_t / sum W_t over the row's group (0 for a group of
    one). Past the second-longest response of a group its longest, if alone, has nobody to
    compare with, and gets 0 there (verl's ``handle_zero_tail``, on in its trainer)."""
    numerator = groups.sum(returns * weights * valid)
    denominator = groups.sum(weights * valid) + OTB_EPSILON
    peers = (groups.size > 1).unsqueeze(-1)
    baselines = torch.where(peers, (numerator / denominator)[groups.ids], torch.zeros_like(returns))
    longest = lengths == groups.amax(lengths)[groups.ids]
    alone = longest & (groups.sum(longest.long()) == 1)[groups.ids]
    second = groups.amax(lengths.masked_fill(longest, -1))[groups.ids]
    steps = torch.arange(returns.shape[-1], device=returns.device)
    return baselines.masked_fill(peers & alone.unsqueeze(-1) & (steps >= second.unsqueeze(-1)), 0.0)


def optimal_token_baseline(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """The optimal token baseline: each token's reward-to-go against a per-position baseline of
    its group, weighted by path variance (``_path_variance``), a lower-variance baseline than a
    group mean. Needs ``old_log_probs`` and ``sum_pi_squared`` (the actor's sum over the
    vocabulary of pi^2 per token); uses ``rollout_is_weights`` if the trainer computed them."""
    rewards = inputs.token_level_rewards
    mask = inputs.response_mask.to(rewards.dtype)
    returns = _reward_to_go(rewards, mask)
    weights = _path_variance(inputs, mask, "optimal_token_baseline")
    groups = Groups.of(inputs.index, len(rewards), rewards.device)
    baselines = _token_baselines(returns, weights, mask, mask.sum(dim=-1).long(), groups)
    return (returns - baselines) * mask, returns * mask


def tir_optimal_token_baseline(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """The optimal token baseline for tool-integrated responses: step t is a response's t-th
    loss token, not its t-th position, so responses whose tool outputs differ in length still
    line up. A response without loss tokens has advantage 0 and is no peer of the others."""
    rewards = inputs.token_level_rewards
    mask = inputs.response_mask.to(rewards.dtype)
    returns = _reward_to_go(rewards, mask)
    weights = _path_variance(inputs, mask, "tir_optimal_token_baseline")
    lengths = mask.sum(dim=-1).long()
    rows, columns = mask.bool().nonzero(as_tuple=True)
    slots = mask.cumsum(dim=-1).long()[rows, columns] - 1  # the loss token's place in its response
    width = int(lengths.max()) if len(lengths) else 0

    def packed(values: Tensor) -> Tensor:
        """Each row's loss tokens moved to its start, zeros after."""
        out = values.new_zeros((len(values), width))
        out[rows, slots] = values[rows, columns]
        return out

    members = (lengths > 0).nonzero(as_tuple=True)[0]
    groups = Groups.of([inputs.index[i] for i in members.tolist()], len(members), rewards.device)
    valid = (torch.arange(width, device=rewards.device) < lengths[members].unsqueeze(-1)).to(rewards.dtype)
    member_returns = packed(returns)[members]
    baselines = _token_baselines(member_returns, packed(weights)[members], valid, lengths[members], groups)
    packed_advantages = returns.new_zeros((len(returns), width))
    packed_advantages[members] = member_returns - baselines
    advantages = torch.zeros_like(returns)
    advantages[rows, columns] = packed_advantages[rows, slots]
    return advantages * mask, returns * mask
