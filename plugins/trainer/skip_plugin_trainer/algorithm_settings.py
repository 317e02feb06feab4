"""The sections of the learning side of ``skip run``, with verl's key names: ``reward``,
``actor``, ``critic`` and ``algorithm``. ``settings.py`` gathers them with the rest and
cross-checks them; like it, this module imports nothing else of the trainer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

KlType = Literal["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OverlongBuffer(_Section):
    """DAPO's overlong reward shaping: a response longer than ``data.max_response_length - len``
    tokens loses ``penalty_factor`` x its excess / ``len`` (at most ``penalty_factor``, at the cap)."""

    enable: bool = False
    len: PositiveInt = 4096
    penalty_factor: NonNegativeFloat = 1.0


class RewardConfig(_Section):
    """``reward``: which function scores responses; ``tool_rewards`` adds the tools' own rewards."""

    function: str = "task"
    tool_rewards: bool = True
    overlong_buffer: OverlongBuffer = OverlongBuffer()


class Optim(_Section):
    lr: PositiveFloat = 1e-5
    weight_decay: NonNegativeFloat = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8


class ActorConfig(_Section):
    """``actor``: the PPO update, with verl's key names.

    ``ppo_mini_batch_size`` counts prompts per optimizer step (each with ``rollout.n``
    samples); ``ppo_micro_batch_size`` counts samples per forward/backward pass, whose
    gradients accumulate over the mini-batch.
    """

    ppo_mini_batch_size: PositiveInt = 16
    ppo_micro_batch_size: PositiveInt = 16
    ppo_epochs: PositiveInt = 1
    clip_ratio_low: NonNegativeFloat = 0.2
    clip_ratio_high: NonNegativeFloat = 0.2
    clip_ratio_c: float | None = Field(3.0, gt=1)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: NonNegativeFloat = 0.001
    kl_loss_type: KlType = "low_var_kl"
    grad_clip: PositiveFloat | None = 1.0
    optim: Optim = Optim()


class CriticConfig(_Section):
    """``critic``: the value model of ``algorithm.adv_estimator=gae``, with verl's key names: the
    policy's architecture with a one-output head, trained beside it on its own optimizer.
    Batch sizes count as the actor's do; ``cliprange_value`` bounds how far one update moves a
    value from the one the advantages used."""

    ppo_mini_batch_size: PositiveInt = 16
    ppo_micro_batch_size: PositiveInt = 16
    ppo_epochs: PositiveInt = 1
    cliprange_value: PositiveFloat = 0.5
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    grad_clip: PositiveFloat | None = 1.0
    optim: Optim = Optim()


class RolloutCorrection(_Section):
    """``algorithm.rollout_correction``, verl's keys: how PPO treats samples whose engine log-probs
    (the behaviour policy) differ from the trainer's, as they do when generation runs on older weights.

    ``bypass_mode``: use the rollout log-probs as PPO's old log-probs (no recomputation); null
    means on for overlapped schedules, off for ``sync``. Off, old log-probs are recomputed and
    ``rollout_is`` (``token`` or ``sequence``) weights each token's loss by the importance ratio
    old / rollout, truncated at ``rollout_is_threshold``.
    """

    bypass_mode: bool | None = None
    rollout_is: Literal["token", "sequence"] | None = None
    rollout_is_threshold: PositiveFloat = 2.0


class FilterGroups(_Section):
    """``algorithm.filter_groups``: DAPO's dynamic sampling. Groups whose ``metric`` is the same
    for every sample are dropped and more prompts generated until the batch is full, at most
    ``max_num_gen_batches`` generations a step (0: no limit). ``acc`` (verl's name) and
    ``score`` read the reward function's score, ``seq_reward`` the whole reward."""

    enable: bool = False
    metric: Literal["acc", "score", "seq_reward"] = "acc"
    max_num_gen_batches: NonNegativeInt = 0


class AlgorithmConfig(_Section):
    """``algorithm``: the advantage estimator (``gae`` trains a critic) and the optional KL
    penalty in the reward; ``gamma`` and ``lam`` are GAE's discount and trace decay."""

    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "gae"] = "grpo"
    gamma: float = 1.0
    lam: float = Field(1.0, ge=0, le=1)
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KlType = "kl"
    kl_coef: NonNegativeFloat = 0.001
    filter_groups: FilterGroups = FilterGroups()
    rollout_correction: RolloutCorrection = RolloutCorrection()
