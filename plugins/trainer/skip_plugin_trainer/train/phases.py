"""The training phases of a step on a rolled-out batch, in verl's order: reward, old and
reference log-probs (and a distillation teacher's), values, advantages, the critic update and
the actor update, each timed under its name in ``skip_core.schedule.TRAIN_PHASES``. The driver
computes rewards and advantages; log-probs and updates run on the policy and critic workers,
which see only ``ACTOR_INPUTS`` and what their phase adds.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from skip_core.batch import Batch
from skip_core.config import ConfigError
from skip_core.layout import Column, Layout
from skip_core.manager import SkipManager
from skip_core.schedule import StepRecord

from skip_plugin_trainer.algorithms.aggregation import agg_loss
from skip_plugin_trainer.algorithms.contract import AdvantageInputs, Estimator
from skip_plugin_trainer.algorithms.correction import correct
from skip_plugin_trainer.algorithms.kl import apply_kl_penalty
from skip_plugin_trainer.config.settings import RunSettings
from skip_plugin_trainer.reward import Rewarder
from skip_plugin_trainer.train.model_group import ModelGroup
from skip_plugin_trainer.train.value import value_metrics

# What the policy worker reads; nothing else crosses to it.
ACTOR_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
# What a reward function reads beside the tokens.
REWARD_INPUTS = ("data_source", "ground_truth", "extra_info", "reward_scores")
# What each cached phase returns, one row per sample and a column per response token: a cached
# result that does not fit is computed again, not loaded (``skip_core.layout``).
PER_TOKEN = Column("float32", "response")
REWARD = Layout({"token_level_scores": PER_TOKEN})
OLD_LOG_PROB = Layout(
    {"old_log_probs": PER_TOKEN, "entropys": PER_TOKEN, "sum_pi_squared": Column("float32", "response", required=False)}
)
REF_LOG_PROB = Layout({"ref_log_prob": PER_TOKEN})
VALUES = Layout({"values": PER_TOKEN})


class Phases:
    """A method a skip role wraps is named for its role (``reward``, ``old_log_prob``,
    ``ref_log_prob``, ``values``); ``compute_*`` puts a phase's result into the step's batch.

    ``overlapped``: the schedule generates with older weights, so by default the rollout
    log-probs are PPO's old log-probs (``algorithm.rollout_correction.bypass_mode``)."""

    def __init__(
        self,
        settings: RunSettings,
        actor: ModelGroup,
        rewarder: Rewarder,
        overlapped: bool,
        critic: ModelGroup | None = None,
    ) -> None:
        self.settings, self.actor, self.rewarder, self.critic = settings, actor, rewarder, critic
        self.correction = settings.algorithm.rollout_correction
        self.bypass = settings.bypass_mode(overlapped)
        if self.bypass and "sum_pi_squared" in settings.estimator().needs:  # bypass skips the pass that gives it
            raise ConfigError(
                f"algorithm.adv_estimator: {settings.algorithm.adv_estimator} needs the old log-prob pass, which "
                "bypass mode skips; set algorithm.rollout_correction.bypass_mode=false"
            )
        loss_mode = settings.actor.policy_loss.loss_mode
        if self.bypass and loss_mode not in ("vanilla", "bypass_mode"):
            warnings.warn(
                f"actor.policy_loss.loss_mode: {loss_mode} is replaced by bypass mode's loss "
                f"(algorithm.rollout_correction.loss_type={self.correction.loss_type}), as in verl",
                stacklevel=2,
            )

    def train(self, batch: Batch, record: StepRecord) -> None:
        if "token_level_scores" not in batch.batch:  # dynamic sampling scored it already
            with record.timed("reward"):
                self.compute_reward(batch)
        if self.bypass:
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        else:
            with record.timed("old_log_prob"):
                record.metrics.update(self.compute_old_log_prob(batch))
        if self.settings.use_reference:
            with record.timed("ref"):
                ref = self.ref_log_prob(batch.select(ACTOR_INPUTS, [], []))
                batch.batch["ref_log_prob"] = ref.batch["ref_log_prob"]
        if self.settings.distillation.enabled:
            with record.timed("teacher"):
                teacher = self.actor.compute_teacher_log_prob(batch.select(ACTOR_INPUTS, [], []))
                batch.batch["teacher_log_prob"] = teacher.batch["teacher_log_prob"]
        if self.critic is not None:
            with record.timed("values"):
                batch.batch["values"] = self.values(batch.select(ACTOR_INPUTS, [], [])).batch["values"]
        with record.timed("adv"):
            record.metrics.update(self.compute_advantage(batch))
        if self.critic is not None:
            with record.timed("update_critic"):
                record.metrics.update(self.update_critic(batch))
        if record.step >= self.settings.trainer.critic_warmup:  # verl: the critic alone before it (actor_updates)
            with record.timed("update_actor"):
                record.metrics.update(self.update_actor(batch))

    def compute_reward(self, batch: Batch) -> None:
        present = [key for key in REWARD_INPUTS if key in batch.non_tensor_batch]
        out = self.reward(batch.select(ACTOR_INPUTS, present, []))
        batch.batch["token_level_scores"] = out.batch["token_level_scores"]
        batch.non_tensor_batch.update(out.non_tensor_batch)

    @SkipManager.annotate(role="reward", layout=REWARD)
    def reward(self, inputs: Batch) -> Batch:
        """Token-level scores and their parts: skip's ``reward`` role replays them on its steps,
        only for the very prompts and responses they scored (its fingerprint covers both)."""
        scores, parts = self.rewarder(inputs)
        return Batch({"token_level_scores": scores}, parts)

    def compute_old_log_prob(self, batch: Batch) -> dict[str, float]:
        out = self.old_log_prob(batch.select(ACTOR_INPUTS, [], []))
        batch.batch["old_log_probs"] = out.batch["old_log_probs"]
        if "sum_pi_squared" in out.batch:  # actor.calculate_sum_pi_squared
            batch.batch["sum_pi_squared"] = out.batch["sum_pi_squared"]
        mask = batch.batch["response_mask"]
        metrics = {"actor/entropy": agg_loss(out.batch["entropys"], mask, self.settings.actor.loss_agg_mode).item()}
        if "rollout_log_probs" in batch.batch and mask.any():
            # How far the engine's log-probs are from the trainer's: a mismatch bias in the ratio.
            diff = (batch.batch["rollout_log_probs"].exp() - out.batch["old_log_probs"].exp()).abs()[mask.bool()]
            metrics["training/rollout_probs_diff_max"] = diff.max().item()
            metrics["training/rollout_probs_diff_mean"] = diff.mean().item()
        return metrics

    @SkipManager.annotate(role="old_log_prob", layout=OLD_LOG_PROB)
    def old_log_prob(self, inputs: Batch) -> Batch:
        """``old_log_probs`` and ``entropys`` under the weights about to be updated: skip's
        ``old_log_prob`` role replays them on its steps (exact when every earlier step was)."""
        return self.actor.compute_log_prob(inputs)

    def rollout_correction(self, batch: Batch) -> dict[str, float]:
        """Decoupled mode's correction, once per batch (verl's
        ``compute_rollout_correction_and_add_to_batch``): weights old / rollout for the loss
        (``rollout_is``), and the response mask less the tokens ``rollout_rs`` rejects, so that
        advantages, the critic, the loss and the batch's metrics see only the tokens kept;
        ``rollout_corr/*`` measures the gap either way."""
        tensors = batch.batch
        weights, mask, metrics = correct(
            self.correction, tensors["old_log_probs"], tensors["rollout_log_probs"], tensors["response_mask"]
        )
        batch.batch["response_mask"] = mask
        if weights is not None:
            batch.batch["rollout_is_weights"] = weights
        return metrics

    @SkipManager.annotate(role="ref_log_prob", layout=REF_LOG_PROB)
    def ref_log_prob(self, inputs: Batch) -> Batch:
        """Log-probs of the responses under the frozen reference model: skip's ``ref_log_prob``
        role replays them on its steps (exact: same reference weights, same inputs)."""
        return self.actor.compute_ref_log_prob(inputs)

    @SkipManager.annotate(role="values", layout=VALUES)
    def values(self, inputs: Batch) -> Batch:
        """The critic's ``values``: skip's ``values`` role replays them on its steps (exact when
        every earlier step was, so the critic holds the same weights)."""
        return self.critic.compute_values(inputs)

    def compute_advantage(self, batch: Batch) -> dict[str, float]:
        algo, metrics = self.settings.algorithm, {}
        scores, mask = batch.batch["token_level_scores"], batch.batch["response_mask"]
        if algo.use_kl_in_reward:
            rewards, kl = apply_kl_penalty(
                scores, mask, batch.batch["old_log_probs"], batch.batch["ref_log_prob"],
                coef=algo.kl_coef, mode=algo.kl_penalty,
            )  # fmt: skip
            batch.batch["token_level_rewards"] = rewards
            metrics = {"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": algo.kl_coef}
        else:
            batch.batch["token_level_rewards"] = scores
        if not self.bypass and "rollout_log_probs" in batch.batch:
            # verl's order: after the KL penalty, which saw every token, before the advantages
            metrics |= self.rollout_correction(batch)
            mask = batch.batch["response_mask"]
        rewards, given = batch.batch["token_level_rewards"], batch.batch
        estimator = self.settings.estimator()
        inputs = AdvantageInputs(
            rewards, mask, batch.non_tensor_batch["uid"],
            values=given.get("values"), reward_baselines=given.get("reward_baselines"),
            old_log_probs=given.get("old_log_probs"), sum_pi_squared=given.get("sum_pi_squared"),
            rollout_is_weights=given.get("rollout_is_weights"), scores=self._named_scores(batch, estimator),
        )  # fmt: skip
        advantages, returns = estimator.compute(inputs, algo)
        if inputs.values is not None:
            metrics |= value_metrics(inputs.values, returns, mask)
        batch.batch["advantages"], batch.batch["returns"] = advantages, returns
        return metrics

    def _named_scores(self, batch: Batch, estimator: Estimator) -> dict[str, torch.Tensor]:
        """The reward function's named numbers GDPO normalises (``algorithm.gdpo_reward_keys``),
        one float per row; a key no sample of the batch returned is refused naming it."""
        if "scores" not in estimator.needs:
            return {}
        keys, extras = self.settings.algorithm.gdpo_reward_keys or (), batch.non_tensor_batch
        missing = [key for key in keys if key not in extras]
        if missing:
            raise ValueError(
                f"algorithm.gdpo_reward_keys: {', '.join(missing)} not among what the reward function returned "
                "beside its score (a dict's numbers)"
            )
        return {key: torch.as_tensor(np.asarray(extras[key], dtype=np.float64), dtype=torch.float32) for key in keys}

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self.critic.update(batch.select([*ACTOR_INPUTS, "values", "returns"], [], []))

    def update_actor(self, batch: Batch) -> dict[str, float]:
        keys = [*ACTOR_INPUTS, "old_log_probs", "advantages"]
        if self.settings.actor.use_kl_loss:
            keys.append("ref_log_prob")
        if "rollout_is_weights" in batch.batch:
            keys.append("rollout_is_weights")
        if self.settings.distillation.enabled:
            keys.append("teacher_log_prob")
        inputs = batch.select(keys, [], [])
        if self.bypass:  # verl's apply_bypass_mode: the policy's loss corrects against the rollout's log-probs
            inputs.meta_info["rollout_correction"] = self.correction
        return self.actor.update(inputs)


def actor_updates(step: int, critic_warmup: int) -> int:
    """How many actor updates steps 1 to ``step`` made: ``Phases.train`` updates the actor on the
    steps from ``critic_warmup`` on (verl's rule), the critic on every step."""
    return max(0, step - max(critic_warmup - 1, 0))
