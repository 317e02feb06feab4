"""What a policy loss and an advantage estimator are given and return, and how the trainer finds
the one a config names.

Both register through the trainer's hooks (``skip_register_policy_losses``,
``skip_register_advantage_estimators``), as verl's ``@register_policy_loss`` and
``@register_adv_est`` do in its ``core_algos.py``: a distribution of one's own adds one with an
entry point, and ``actor.policy_loss.loss_mode`` / ``algorithm.adv_estimator`` select it by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from skip_plugin_trainer.algorithms.aggregation import Totals, agg_loss, token_share
from skip_plugin_trainer.config.algorithm import ActorConfig, AlgorithmConfig, RolloutCorrection


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's tensors, ``[batch, response_len]``: the log-probs the samples were scored
    with before the update (``old_log_prob``) and now (``log_prob``, with its gradient), their
    advantages, the loss tokens, and the rollout correction's importance weights (None: none)."""

    old_log_prob: Tensor
    log_prob: Tensor
    advantages: Tensor
    response_mask: Tensor
    weights: Tensor | None = None

    def weighted(self, losses: Tensor) -> Tensor:
        """Per-token ``losses`` scaled by the importance weights, if any."""
        return losses if self.weights is None else losses * self.weights.float()


@dataclass(frozen=True)
class LossContext:
    """The actor's settings and the mini-batch a micro-batch is part of (``mask``: the
    micro-batch's loss tokens).

    ``agg`` and ``mean`` divide by the whole mini-batch's totals, so a loss and its metrics are
    this micro-batch's parts: summed over micro-batches and ranks they are the mini-batch's.
    """

    actor: ActorConfig
    totals: Totals
    mask: Tensor
    correction: RolloutCorrection | None = None  # bypass mode's, which its loss reads

    def agg(self, loss_mat: Tensor, mode: str | None = None, mask: Tensor | None = None) -> Tensor:
        """``loss_mat`` reduced by ``actor.loss_agg_mode`` (or ``mode``, for a loss that fixes its own)."""
        mode = mode or self.actor.loss_agg_mode
        return agg_loss(loss_mat, self.mask if mask is None else mask, mode, self.totals, self.actor.loss_scale_factor)

    def mean(self, values: Tensor) -> float:
        """This micro-batch's part of the mini-batch's mean of ``values`` over its loss tokens."""
        return token_share(values.detach().float(), self.mask, self.totals)


@dataclass(frozen=True)
class PolicyLoss:
    """The loss to backpropagate and its metrics by verl's names. Those under ``actor/``
    (``actor/pg_clipfrac``, ``actor/ppo_kl`` ...) are parts as ``LossContext.mean`` gives them,
    summed over micro-batches and ranks; any other (bypass mode's ``rollout_corr/*``) is one
    value per micro-batch, averaged."""

    loss: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


LossFunction = Callable[[LossInputs, LossContext], PolicyLoss]


@dataclass(frozen=True)
class AdvantageInputs:
    """A batch's tensors for an estimator: its rewards per token, loss tokens and prompt groups
    (``index``: one id per row, the rows of one prompt sharing it), and what some estimators need
    besides (``needs`` of an ``Estimator``): ``values`` (the critic's), ``reward_baselines`` (the
    score of each prompt's greedy response, ReMax's), ``old_log_probs`` and ``sum_pi_squared``
    (the optimal token baseline's), ``rollout_is_weights``, and ``scores``: the reward
    function's named parts per row (GDPO's)."""

    token_level_rewards: Tensor
    response_mask: Tensor
    index: np.ndarray | Sequence[str]
    values: Tensor | None = None
    reward_baselines: Tensor | None = None
    old_log_probs: Tensor | None = None
    sum_pi_squared: Tensor | None = None
    rollout_is_weights: Tensor | None = None
    scores: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: ``compute(inputs, config) -> (advantages, returns)``; ``needs``
    names the optional ``AdvantageInputs`` it reads, which the trainer then provides (``values``
    trains a critic)."""

    name: str
    compute: Callable[[AdvantageInputs, AlgorithmConfig], tuple[Tensor, Tensor]]
    needs: frozenset[str] = frozenset()


def policy_loss(name: str) -> LossFunction:
    """The registered loss ``name`` (``actor.policy_loss.loss_mode``, which the run's settings
    check first), or a one-line error naming what is registered."""
    from skip_core.plugins import registry

    losses = registry().policy_losses
    if name not in losses:
        raise ValueError(f"actor.policy_loss.loss_mode: unknown {name!r}; registered: {', '.join(sorted(losses))}")
    return losses[name]
