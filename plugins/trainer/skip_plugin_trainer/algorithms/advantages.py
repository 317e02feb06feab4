"""verl 0.9.1's outcome advantage estimators, and ``ESTIMATORS``: all fourteen of verl's, by its
names, with what each needs (the token-level ones are in ``token_advantages.py``).

An outcome estimator gives each response one advantage: its score (its rewards summed, every
token, as verl sums them) against the other responses to its prompt (its group, rows sharing an
``index`` id), broadcast over its loss tokens. Each returns ``(advantages, returns)``, both
``[batch, response_len]`` and 0 off the mask; for these two they are the same tensor.

The numbers are verl's to float32 rounding, which takes some care: where verl divides by a
group's standard deviation, a group whose scores are all equal has a std of rounding noise, so
its mean and std are taken as verl takes them, ``torch.mean`` / ``torch.std`` of the group's
scores in batch order (``Groups.each``), never by a scatter that rounds differently. The
``_vectorized`` estimators are verl's scatter versions, and match those instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from skip_plugin_trainer.algorithms.aggregation import masked_whiten
from skip_plugin_trainer.algorithms.contract import AdvantageInputs, Estimator
from skip_plugin_trainer.algorithms.groups import Groups
from skip_plugin_trainer.algorithms.token_advantages import (
    gae,
    needed,
    optimal_token_baseline,
    reinforce_plus_plus,
    tir_optimal_token_baseline,
)
from skip_plugin_trainer.config.algorithm import AlgorithmConfig

EPSILON = 1e-6  # verl's: keeps the advantages of a group with equal scores finite


def _scores(inputs: AdvantageInputs) -> tuple[Tensor, Tensor, Groups]:
    scores = inputs.token_level_rewards.sum(dim=-1)
    mask = inputs.response_mask.to(scores.dtype)
    return scores, mask, Groups.of(inputs.index, len(scores), scores.device)


def _per_token(scalars: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    advantages = scalars.unsqueeze(-1) * mask
    return advantages, advantages


def _group_means(scores: Tensor, groups: Groups) -> Tensor:
    """Each row's group mean; a group of one has 0, so its advantage is its score."""
    return groups.each(lambda rows: torch.mean(scores[rows]), scores.new_tensor(0.0))[groups.ids]


def _group_stds(scores: Tensor, groups: Groups) -> Tensor:
    """Each row's group std (unbiased); a group of one has 1."""
    return groups.each(lambda rows: torch.std(scores[rows]), scores.new_tensor(1.0))[groups.ids]


def _grpo_scalars(scores: Tensor, groups: Groups, norm_by_std: bool) -> Tensor:
    centred = scores - _group_means(scores, groups)
    return centred / (_group_stds(scores, groups) + EPSILON) if norm_by_std else centred


def grpo(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """GRPO: a score against its group's mean, over its std unless ``norm_adv_by_std_in_grpo``
    is off (Dr.GRPO). No value model: the group is the baseline."""
    scores, mask, groups = _scores(inputs)
    return _per_token(_grpo_scalars(scores, groups, config.norm_adv_by_std_in_grpo), mask)


def grpo_vectorized(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """GRPO with the group statistics by scatter, as verl's ``grpo_vectorized``: equal to
    ``grpo`` but where a group's std is rounding noise (equal scores that do not add up exactly).

    verl's trainer does not pass ``norm_adv_by_std_in_grpo`` to this one (so it always divides);
    here the setting applies, as it does to ``grpo``.
    """
    scores, mask, groups = _scores(inputs)
    count = groups.sum(torch.ones_like(scores))
    mean = groups.sum(scores) / count.clamp_min(1.0)
    centred = scores - mean[groups.ids]
    std = torch.sqrt(torch.clamp(groups.sum(centred * centred) / (count - 1.0).clamp_min(1.0), min=0.0))
    single = count <= 1.0
    mean, std = mean.masked_fill(single, 0.0), std.masked_fill(single, 1.0)
    centred = scores - mean[groups.ids]
    if config.norm_adv_by_std_in_grpo:
        return _per_token(centred / (std[groups.ids] + EPSILON), mask)
    return _per_token(centred, mask)


def gdpo(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """GDPO: each reward part normalised in its group as GRPO does, so a part with a large scale
    does not drown the others, then their weighted sum whitened over the batch's loss tokens.

    The parts are ``inputs.scores[key]`` for each of ``algorithm.gdpo_reward_keys``: the reward
    function's returned dict's entries, one float per row. verl reads them from
    ``non_tensor_batch[key]`` (where its reward manager puts ``compute_score``'s dict) and places
    each at the response's last token before summing, which gives the same per-row score.
    ``gdpo_reward_weights`` weigh them (null: 1 each). As for ``grpo_vectorized``, verl's trainer
    leaves ``norm_adv_by_std_in_grpo`` at true here; skip applies the setting.
    """
    _, mask, groups = _scores(inputs)
    keys = config.gdpo_reward_keys
    if not keys:
        raise ValueError("algorithm.gdpo_reward_keys: gdpo needs the keys of the reward parts to normalise")
    missing = [key for key in keys if key not in inputs.scores]
    if missing:
        raise ValueError(f"algorithm.gdpo_reward_keys: {missing} not among the reward's scores {sorted(inputs.scores)}")
    weights = config.gdpo_reward_weights or (1.0,) * len(keys)
    if len(weights) != len(keys):
        raise ValueError(f"algorithm.gdpo_reward_weights: {len(weights)} weights for {len(keys)} keys")
    weights = torch.tensor(weights, dtype=torch.float32, device=mask.device)
    total = None
    for key, weight in zip(keys, weights, strict=True):
        part = inputs.scores[key].to(device=mask.device, dtype=torch.float32)
        term = weight * _per_token(_grpo_scalars(part, groups, config.norm_adv_by_std_in_grpo), mask)[0]
        total = term if total is None else total + term
    return _per_token_whitened(total, mask)


def _per_token_whitened(advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    advantages = masked_whiten(advantages, mask) * mask
    return advantages, advantages


def grpo_passk(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Pass@k training: only a group's best response is credited, by its lead over the second
    best (over the group's std with ``norm_adv_by_std_in_grpo``); a tie for best credits none.
    Every prompt needs two responses at least."""
    scores, mask, groups = _scores(inputs)
    if bool((groups.size < 2).any()):
        raise ValueError("grpo_passk needs at least 2 responses per prompt (rollout.n >= 2)")
    best = groups.amax(scores)
    is_best = scores == best[groups.ids]
    runner_up = groups.amax(scores.masked_fill(is_best, float("-inf")))
    lead = best - runner_up
    if config.norm_adv_by_std_in_grpo:
        lead = lead / (groups.each(lambda rows: torch.std(scores[rows]), scores.new_tensor(1.0)) + EPSILON)
    alone = is_best & (groups.sum(is_best.to(scores.dtype)) == 1)[groups.ids]
    return _per_token(torch.where(alone, lead[groups.ids], torch.zeros_like(scores)), mask)


def reinforce_plus_plus_baseline(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a baseline: a score against its group's mean, then whitened over the
    batch's loss tokens (not within the group, unlike GRPO)."""
    scores, mask, groups = _scores(inputs)
    return _per_token_whitened((scores - _group_means(scores, groups)).unsqueeze(-1) * mask, mask)


def rloo(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """RLOO: a score against the mean of the other responses to its prompt, written as verl
    does, n / (n - 1) x (score - group mean). A response alone keeps its score."""
    scores, mask, groups = _scores(inputs)
    n = groups.size
    left_out = scores * n / (n - 1) - _group_means(scores, groups) * n / (n - 1)
    return _per_token(torch.where(n > 1, left_out, scores), mask)


def rloo_vectorized(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """RLOO by scatter, as verl's ``rloo_vectorized``; unlike ``rloo``, a response alone gets 0."""
    scores, mask, groups = _scores(inputs)
    n = groups.size
    advantages = ((n * scores - groups.sum(scores)[groups.ids]) / (n - 1).clamp_min(1)) * (n > 1)
    return _per_token(advantages, mask)


def opo(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """OPO: the baseline is the group's mean score weighted by response length (loss tokens).

    A group whose responses have no loss token at all has baseline 0 here, where verl's 0 / 0
    is NaN (and NaN x mask stays NaN, reaching the loss).
    """
    scores, mask, groups = _scores(inputs)
    length = mask.sum(dim=-1)

    def baseline(rows: Tensor) -> Tensor:
        return (length[rows] * scores[rows]).sum() / length[rows].sum().clamp_min(1.0)

    return _per_token(scores - groups.each(baseline, scores.new_tensor(0.0))[groups.ids], mask)


def remax(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """ReMax: each token's reward-to-go against the score of its prompt's greedy response
    (``reward_baselines``, one per row)."""
    baselines = needed(inputs, "reward_baselines", "remax")
    mask = inputs.response_mask.to(inputs.token_level_rewards.dtype)
    returns = (inputs.token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - baselines.unsqueeze(-1) * mask
    return advantages * mask, returns * mask


def gpg(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """GPG: a score against its group's mean, scaled by batch size / responses with a nonzero
    score, which makes up for the groups that teach nothing. (verl also divides by its
    ``f_norm``, which its trainer leaves at 1.)"""
    scores, mask, groups = _scores(inputs)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    return _per_token(alpha * (scores - _group_means(scores, groups)), mask)


_OTB_NEEDS = frozenset({"old_log_probs", "sum_pi_squared", "rollout_is_weights"})

ESTIMATORS: tuple[Estimator, ...] = (
    Estimator("gae", gae, frozenset({"values"})),
    Estimator("grpo", grpo),
    Estimator("grpo_vectorized", grpo_vectorized),
    Estimator("gdpo", gdpo, frozenset({"scores"})),
    Estimator("grpo_passk", grpo_passk),
    Estimator("reinforce_plus_plus_baseline", reinforce_plus_plus_baseline),
    Estimator("rloo", rloo),
    Estimator("rloo_vectorized", rloo_vectorized),
    Estimator("opo", opo),
    Estimator("reinforce_plus_plus", reinforce_plus_plus),
    Estimator("remax", remax, frozenset({"reward_baselines"})),
    Estimator("gpg", gpg),
    Estimator("optimal_token_baseline", optimal_token_baseline, _OTB_NEEDS),
    Estimator("tir_optimal_token_baseline", tir_optimal_token_baseline, _OTB_NEEDS),
)
