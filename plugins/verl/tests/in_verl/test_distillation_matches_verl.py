"""skip's on-policy distillation loss against verl 0.9.1's (``trainer/distillation/losses.py``) on the
same tensors: the loss, its gradient and the metrics both report, for each single-sample estimator,
supervised and as a policy gradient, clamped or not, under each loss aggregation mode; and the
actor's final loss, the task's policy loss combined with it (verl's ``distillation_ppo_loss``). The
batch is one whole mini-batch (verl's trainer passes its sizes as ``global_batch_info``; skip its
``Totals``), laid out for verl as its engine's no-padding output."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
from pydantic import ValidationError
from skip_core.plugins import registry
from skip_plugin_trainer.algorithms.aggregation import LOSS_AGG_MODES, Totals
from skip_plugin_trainer.algorithms.contract import LossContext, LossInputs
from skip_plugin_trainer.algorithms.distillation import combined, distillation_loss
from skip_plugin_trainer.config.algorithm import ActorConfig
from skip_plugin_trainer.config.distillation import DistillationLoss
from test_policy_losses_match_verl import batch as policy_loss_batch  # the same tensors' shapes and masks
from verl.trainer.distillation import losses as verl_distillation
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.workers.config import DistillationConfig, DistillationLossConfig, FSDPActorConfig

# The actor's bounds differ from the distillation section's, and its dual clip (2) from the 3 verl's
# distillation policy gradient falls back to, so a loss reading the wrong section shows.
ACTOR = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 2.0}
DISTILL = {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "distillation_loss_coef": 0.7}
ESTIMATORS = sorted(n for n, s in verl_distillation.DISTILLATION_SETTINGS_REGISTRY.items() if s.use_estimator)
CLAMP = 0.5  # below many tokens' divergence in either sign, so the clamp bites
# Each estimator with and without the policy gradient, but k1 (kl) only with it: skip refuses it otherwise.
CASES = [(name, pg) for name in ESTIMATORS for pg in (True, False) if pg or name not in ("k1", "kl")]
# Metrics verl reports that skip does not (verl's per-micro-batch min / max of the loss).
VERL_ONLY = {"distillation/loss_min", "distillation/loss_max"}


def batch(seed: int) -> dict[str, torch.Tensor]:
    """The policy-loss tests' batch with ratios to the old policy from 0.22 to 4.5 (beyond both
    clip bounds and the dual clip), and the teacher's log-probs drawn apart from the student's
    (divergences past the clamp, k3 past its bound of 10)."""
    data = policy_loss_batch(seed, spread=1.5)
    generator = torch.Generator().manual_seed(1000 + seed)
    return {**data, "teacher": torch.empty(6, 8).uniform_(0.002, 0.95, generator=generator).log()}


def verl_run(data: dict, mode: str, settings: dict, whole: bool, weighted: bool = False):
    """verl's ``distillation_loss`` (or, ``whole``, ``distillation_ppo_loss``) on ``data``, each row
    one prompt token and its response, flattened as the engine's no-padding output."""
    actor = FSDPActorConfig(
        strategy="fsdp", ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=6, rollout_n=1, clip_ratio=0.2,
        loss_agg_mode=mode, **ACTOR,
    )  # fmt: skip
    config = DistillationConfig(distillation_loss=DistillationLossConfig(**DISTILL, **settings))
    mask = data["mask"]
    rows, width = mask.shape

    def flat(values: torch.Tensor) -> torch.Tensor:  # output at position t predicts token t + 1
        return torch.cat([values, values.new_zeros(rows, 1)], dim=1).flatten()

    teacher = torch.nested.as_nested_tensor(list(flat(data["teacher"]).view(rows, -1, 1)), layout=torch.jagged)
    tensors = {
        "prompts": torch.zeros(rows, 1, dtype=torch.long),
        "responses": torch.zeros(rows, width, dtype=torch.long),
        "attention_mask": torch.ones(rows, width + 1, dtype=torch.long),
        "response_mask": mask,
        "old_log_probs": data["old"],
        "advantages": data["advantages"],
        "teacher_logprobs": teacher,  # one sequence a row, as verl's teacher engine gives them
        **({"rollout_is_weights": data["weights"]} if weighted else {}),
    }  # fmt: skip
    sizes = {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": rows}
    log_prob = data["log_prob"].clone().requires_grad_()
    loss_fn = verl_distillation.distillation_ppo_loss if whole else verl_distillation.distillation_loss
    loss, metrics = loss_fn(actor, config, {"log_probs": flat(log_prob)}, tu.get_tensordict(tensors, sizes))
    loss.backward()
    values = {key: float(value.aggregate() if isinstance(value, Metric) else value) for key, value in metrics.items()}
    return loss.detach(), log_prob.grad, values


def skip_run(data: dict, mode: str, settings: dict, whole: bool, weighted: bool = False):
    """skip's ``distillation_loss`` (or, ``whole``, its ``combined`` with the task's vanilla loss,
    with the metrics its trainer reports beside them)."""
    actor = ActorConfig(loss_agg_mode=mode, **ACTOR)
    config = DistillationLoss(**DISTILL, **settings)
    mask = data["mask"]
    log_prob = data["log_prob"].clone().requires_grad_()
    inputs = LossInputs(data["old"], log_prob, data["advantages"], mask, data["weights"] if weighted else None)
    ctx = LossContext(actor, Totals.of(mask), mask)
    distilled = distillation_loss(inputs, data["teacher"], ctx, config)
    loss, metrics = distilled.loss, dict(distilled.metrics)
    if whole:
        task = None
        if config.use_task_rewards or config.use_policy_gradient:  # verl computes it only then
            task = registry().policy_losses["vanilla"](inputs, ctx)
            metrics.update(task.metrics, **{"actor/pg_loss": task.loss.item()})
        metrics["distillation/loss"] = distilled.loss.item()
        loss = combined(task and task.loss, distilled.loss, config)
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


def assert_same(got, expected) -> None:
    (loss, grad, metrics), (verl_loss, verl_grad, verl_metrics) = got, expected
    torch.testing.assert_close(loss, verl_loss.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, verl_grad, atol=1e-6, rtol=1e-5)
    assert sorted(metrics) == sorted(set(verl_metrics) - VERL_ONLY)
    for key, value in metrics.items():
        assert value == pytest.approx(verl_metrics[key], rel=1e-5, abs=1e-6), key


def test_skip_has_every_estimator_verl_has():
    assert sorted(get_args(DistillationLoss.model_fields["loss_mode"].annotation)) == ESTIMATORS


@pytest.mark.parametrize("name", ["k1", "kl"])
def test_k1_without_a_policy_gradient_is_refused(name):
    with pytest.raises(ValidationError, match="use_policy_gradient"):
        DistillationLoss(loss_mode=name, use_policy_gradient=False)
    if name == "k1":
        with pytest.raises(ValueError, match="k1"):
            DistillationLossConfig(loss_mode=name, use_policy_gradient=False)
    else:  # verl checks the name k1 only; its alias kl, the same estimator, passes (skip is stricter)
        DistillationLossConfig(loss_mode=name, use_policy_gradient=False)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("clamp", [None, CLAMP], ids=["unclamped", "clamped"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize(("name", "pg"), CASES, ids=[f"{name}-{'pg' if pg else 'direct'}" for name, pg in CASES])
def test_distillation_loss_is_verls(name, pg, mode, clamp, seed):
    data = batch(seed)
    settings = {"loss_mode": name, "use_policy_gradient": pg, "loss_max_clamp": clamp}
    if clamp is not None:
        per_token = verl_distillation.kl_penalty(data["log_prob"], data["teacher"], name)
        assert (per_token[data["mask"].bool()].abs() > clamp).any()
    assert_same(skip_run(data, mode, settings, whole=False), verl_run(data, mode, settings, whole=False))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize(("name", "pg"), CASES, ids=[f"{name}-{'pg' if pg else 'direct'}" for name, pg in CASES])
@pytest.mark.parametrize("task_rewards", [True, False], ids=["with_task", "distillation_only"])
def test_combined_loss_is_verls(task_rewards, name, pg, mode, seed):
    data = batch(seed)
    settings = {"loss_mode": name, "use_policy_gradient": pg, "loss_max_clamp": CLAMP, "use_task_rewards": task_rewards}
    assert_same(skip_run(data, mode, settings, whole=True), verl_run(data, mode, settings, whole=True))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("pg", [True, False], ids=["pg", "direct"])
def test_rollout_correction_weights(pg, mode):
    """With the rollout correction's importance weights in the batch (decoupled mode's ``rollout_is``):
    the task's loss weighs each token by them; verl's distillation loss too, as a policy gradient."""
    data = batch(2)
    settings = {"loss_mode": "k3", "use_policy_gradient": pg}
    assert_same(
        skip_run(data, mode, settings, True, weighted=True), verl_run(data, mode, settings, True, weighted=True)
    )
