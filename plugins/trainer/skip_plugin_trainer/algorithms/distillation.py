"""verl's on-policy distillation (``distillation.*``): the student is pulled toward a teacher
model on the tokens the student sampled, as in verl 0.9.1's ``trainer/distillation/losses.py``.

Each response token's divergence from the teacher is estimated from the two log-probs of the
sampled token alone (``loss_mode``: ``k1``/``kl``, ``abs``, ``k2``/``mse``, ``k3``/``low_var_kl``,
verl's KL estimators). It is either backpropagated as a supervised loss, aggregated as the
policy loss is, or, with ``use_policy_gradient``, its negative is each token's advantage in a
registered policy loss (Thinking Machines' on-policy distillation). With ``use_task_rewards``
the task's policy loss stays and the distillation loss is added at ``distillation_loss_coef``;
without, the distillation loss is all the actor trains on.

skip's teacher is a frozen model the policy worker holds beside the student, scoring each
sampled sequence in one forward at the rollout temperature (verl asks the teacher's inference
engine for the prompt log-probs of the whole sequence).
"""

from __future__ import annotations

from torch import Tensor

from skip_plugin_trainer.algorithms.contract import LossContext, LossInputs, PolicyLoss, policy_loss
from skip_plugin_trainer.algorithms.kl import kl_penalty
from skip_plugin_trainer.config.distillation import DistillationLoss


def distillation_loss(
    inputs: LossInputs, teacher_log_prob: Tensor, ctx: LossContext, config: DistillationLoss
) -> PolicyLoss:
    """The distillation loss of one micro-batch and its metrics (verl's ``distillation_loss``),
    as parts of the mini-batch's, like a policy loss's."""
    per_token = kl_penalty(inputs.log_prob, teacher_log_prob, config.loss_mode)
    metrics = {"distillation/abs_loss": ctx.mean(per_token.abs())}
    if config.loss_max_clamp is not None:  # both ways: k1 can be negative
        per_token = per_token.clamp(-config.loss_max_clamp, config.loss_max_clamp)
    if not config.use_policy_gradient:
        return PolicyLoss(ctx.agg(per_token), metrics)
    # the negative divergence as each token's advantage, through a policy loss with the
    # distillation section's clip ranges (verl passes that section as the loss's config: it has
    # no dual-clip bound, so the loss takes its default, 3)
    bounds = {"clip_ratio_low": config.clip_ratio_low, "clip_ratio_high": config.clip_ratio_high}
    clips = {name: config.clip_ratio if value is None else value for name, value in bounds.items()}
    actor = ctx.actor.model_copy(update={**clips, "clip_ratio_c": 3.0})
    rewarded = LossInputs(
        inputs.old_log_prob, inputs.log_prob, -per_token.detach(), inputs.response_mask, inputs.weights
    )
    result = policy_loss(config.policy_loss_mode)(rewarded, LossContext(actor, ctx.totals, ctx.mask))
    metrics.update({f"distillation/{key.removeprefix('actor/')}": value for key, value in result.metrics.items()})
    return PolicyLoss(result.loss, metrics)


def combined(task: Tensor | None, distilled: Tensor, config: DistillationLoss) -> Tensor:
    """The actor's loss: the task's (``None`` when it is not trained on) plus the distillation
    loss, weighed by ``distillation_loss_coef`` beside a task loss (verl's ``distillation_ppo_loss``)."""
    if task is None or not config.use_task_rewards:
        return distilled
    return task + config.distillation_loss_coef * distilled
