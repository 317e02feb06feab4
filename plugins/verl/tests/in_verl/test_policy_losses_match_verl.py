"""Every policy loss skip registers, against verl 0.9.1's own function of that name on the same
tensors: the loss, its gradient and every metric verl reports, under each loss aggregation mode,
with and without the rollout correction's weights. The batch is one whole mini-batch (verl's
trainer passes the mini-batch's sizes as ``global_batch_info``; skip its ``Totals``)."""

from __future__ import annotations

import pytest
import torch
from skip_core.plugins import registry
from skip_plugin_trainer.algorithms.aggregation import LOSS_AGG_MODES, Totals
from skip_plugin_trainer.algorithms.contract import LossContext, LossInputs
from skip_plugin_trainer.config.algorithm import ActorConfig, PolicyLossConfig, RolloutCorrection
from verl.trainer.config import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.workers.config import FSDPActorConfig
from verl.workers.config import PolicyLossConfig as VerlPolicyLoss

NAMES = sorted(core_algos.POLICY_LOSS_REGISTRY)
ACTOR = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05}
# Wide covariance bounds and ratios, so that Clip-Cov and KL-Cov change some tokens of a small batch.
OPTIONS = {"clip_cov_ratio": 0.2, "clip_cov_lb": -5.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.2, "dro_beta": 0.3}
CORRECTIONS = {
    "ppo_clip": {"loss_type": "ppo_clip", "rollout_is": "token", "rollout_is_threshold": 2.0},
    "reinforce": {
        "loss_type": "reinforce",
        "rollout_is": "sequence",
        "rollout_rs": "token_k1",
        "rollout_rs_threshold": 2.0,
    },
}


def batch(seed: int, spread: float = 0.7) -> dict[str, torch.Tensor]:
    """Six rows of eight tokens: ragged masks with a gap and an empty row; ratios from e^-spread
    to e^spread (0.5 to 2), some beyond the clip bounds; advantages of both signs, per row and per token."""
    generator = torch.Generator().manual_seed(seed)
    log_prob = torch.empty(6, 8).uniform_(0.05, 0.95, generator=generator).log()
    old = log_prob + torch.empty(6, 8).uniform_(-spread, spread, generator=generator)
    mask = torch.ones(6, 8)
    mask[1, 5:] = 0
    mask[2, 2:4] = 0  # a tool response
    mask[3, 1:] = 0
    mask[5] = 0  # no loss token at all
    advantages = torch.randn(6, 1, generator=generator).expand(6, 8).clone()
    advantages[4] = torch.randn(8, generator=generator)
    weights = torch.empty(6, 8).uniform_(0.2, 2.0, generator=generator)
    return {
        "old": old.clamp(max=-0.01),
        "log_prob": log_prob,
        "advantages": advantages * mask,
        "mask": mask,
        "weights": weights,
    }


def verl_loss(name: str, mode: str, data: dict, weights: torch.Tensor | None, correction: dict | None):
    corrected = RolloutCorrectionConfig(bypass_mode=True, **correction) if correction else RolloutCorrectionConfig()
    config = FSDPActorConfig(
        strategy="fsdp", ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=6, rollout_n=1, clip_ratio=0.2,
        loss_agg_mode=mode, **ACTOR,
        policy_loss=VerlPolicyLoss(loss_mode=name, rollout_correction=corrected, **OPTIONS),
    )  # fmt: skip
    mask = data["mask"]
    config.global_batch_info.update(dp_size=1, batch_num_tokens=mask.sum(), global_batch_size=mask.shape[0])
    log_prob = data["log_prob"].clone().requires_grad_()
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        data["old"], log_prob, data["advantages"], mask, loss_agg_mode=mode, config=config, rollout_is_weights=weights
    )
    loss.backward()
    return loss.detach(), log_prob.grad, {k: float(v) for k, v in metrics.items()}


def skip_loss(name: str, mode: str, data: dict, weights: torch.Tensor | None, correction: dict | None):
    actor = ActorConfig(loss_agg_mode=mode, policy_loss=PolicyLossConfig(loss_mode=name, **OPTIONS), **ACTOR)
    mask = data["mask"]
    log_prob = data["log_prob"].clone().requires_grad_()
    inputs = LossInputs(data["old"], log_prob, data["advantages"], mask, weights)
    bypass = RolloutCorrection(bypass_mode=True, **correction) if correction else None
    result = registry().policy_losses[name](inputs, LossContext(actor, Totals.of(mask), mask, bypass))
    result.loss.backward()
    return result.loss.detach(), log_prob.grad, result.metrics


def test_skip_registers_every_loss_verl_does():
    assert sorted(registry().policy_losses) == NAMES


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", [name for name in NAMES if name != "bypass_mode"])
def test_each_loss_is_verls(name, mode, weighted, seed):
    data = batch(seed)
    weights = data["weights"] if weighted else None
    torch.manual_seed(seed)  # Clip-Cov draws its tokens from torch's generator, in either
    expected = verl_loss(name, mode, data, weights, None)
    torch.manual_seed(seed)
    got = skip_loss(name, mode, data, weights, None)
    assert_same(got, expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
def test_bypass_mode_is_verls(correction, mode):
    data = batch(3)  # ``old`` plays the rollout's log-probs
    expected = verl_loss("bypass_mode", mode, data, None, CORRECTIONS[correction])
    got = skip_loss("bypass_mode", mode, data, None, CORRECTIONS[correction])
    assert_same(got, expected)


def assert_same(got, expected) -> None:
    (loss, grad, metrics), (verl_loss_, verl_grad, verl_metrics) = got, expected
    torch.testing.assert_close(loss, verl_loss_.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, verl_grad, atol=1e-6, rtol=1e-5)
    assert sorted(metrics) == sorted(verl_metrics)
    for key, value in verl_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
