"""Rollout correction as verl 0.9.1 computes it: importance weights (truncated, IcePop, batch-
normalized), rejection masks, off-policy metrics, bypass mode's losses, and which settings verl
accepts or refuses. The tensors are small enough to check by hand."""

import math

import numpy as np
import pytest
import torch
from batches import ROWS, padded_batch
from skip_core.config import ConfigError
from skip_plugin_trainer.algorithms.aggregation import Totals
from skip_plugin_trainer.algorithms.contract import LossContext, LossInputs, PolicyLoss
from skip_plugin_trainer.algorithms.correction import (
    bypass_mode,
    correct,
    offpolicy_metrics,
    rejection_mask,
    rollout_is_weights,
)
from skip_plugin_trainer.algorithms.losses import reinforce, vanilla
from skip_plugin_trainer.config.algorithm import ActorConfig, Optim, RolloutCorrection
from skip_plugin_trainer.config.settings import RunSettings
from skip_plugin_trainer.train.phases import Phases
from skip_plugin_trainer.train.policy import Policy

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def loss_of(loss, old, log_prob, advantages, mask, weights=None, correction=None, **actor) -> PolicyLoss:
    """``loss`` on one micro-batch that is its whole mini-batch."""
    inputs = LossInputs(old, log_prob, advantages, mask, weights)
    return loss(inputs, LossContext(ActorConfig(**actor), Totals.of(mask), mask, correction))


def bypass_policy_loss(correction, rollout, log_prob, advantages, mask, **actor) -> tuple[PolicyLoss, dict]:
    result = loss_of(bypass_mode, rollout, log_prob, advantages, mask, correction=correction, **actor)
    return result, {k: v for k, v in result.metrics.items() if k.startswith("rollout_corr/")}


ROLLOUT = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.9], [0.2, 0.8, 0.9, 0.9]]))
OLD = torch.log(torch.tensor([[0.5, 0.25, 0.6, 0.1], [0.6, 0.8, 0.1, 0.1]]))
# The ratios old / rollout on the five tokens: 1, 0.5, 1.2 | 3, 1.
RATIOS = [1.0, 0.5, 1.2, 3.0, 1.0]


def metric(metrics, name):
    return metrics[f"rollout_corr/{name}"]


# -- importance weights ----------------------------------------------------------------------


def test_token_weights_are_the_ratio_truncated_and_zero_on_padding():
    weights, metrics = rollout_is_weights(OLD, ROLLOUT, MASK, level="token", threshold=2.0)
    expected = torch.tensor([[1.0, 0.5, 1.2, 0.0], [2.0, 1.0, 0.0, 0.0]])  # 0.6 / 0.2 = 3 is truncated to 2
    torch.testing.assert_close(weights, expected)
    assert metric(metrics, "rollout_is_mean") == pytest.approx(5.7 / 5)  # of the weights applied, as verl
    assert metric(metrics, "rollout_is_max") == pytest.approx(2.0)
    assert metric(metrics, "rollout_is_min") == pytest.approx(0.5)
    assert metric(metrics, "rollout_is_ratio_fraction_high") == pytest.approx(1 / 5)
    applied = torch.tensor([1.0, 0.5, 1.2, 2.0, 1.0])
    assert metric(metrics, "rollout_is_std") == pytest.approx(applied.std(unbiased=False).item(), rel=1e-5)
    assert metric(metrics, "rollout_is_eff_sample_size") == pytest.approx(
        1 / ((applied / applied.mean()) ** 2).mean().item(), rel=1e-5
    )
    assert metric(metrics, "rollout_is_seq_mean") == pytest.approx((2.7 / 3 + 3.0 / 2) / 2)


def test_sequence_weights_are_the_product_over_the_response():
    weights, metrics = rollout_is_weights(OLD, ROLLOUT, MASK, level="sequence", threshold=10.0)
    first, second = 1.0 * 0.5 * 1.2, 3.0 * 1.0
    expected = torch.tensor([[first] * 3 + [0.0], [second] * 2 + [0.0, 0.0]])
    torch.testing.assert_close(weights, expected)
    assert metric(metrics, "rollout_is_max") == pytest.approx(3.0)
    assert metric(metrics, "rollout_is_min") == pytest.approx(0.6)


def test_icepop_zeroes_weights_outside_the_bounds_instead_of_truncating():
    weights, metrics = rollout_is_weights(OLD, ROLLOUT, MASK, level="token", threshold=2.5, lower=0.6)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 0.0, 1.2, 0.0], [0.0, 1.0, 0.0, 0.0]]))
    assert metric(metrics, "rollout_is_oob_ratio") == pytest.approx(2 / 5)  # 0.5 below, 3 above


def test_batch_normalized_token_weights_have_mean_one_and_log_the_factor():
    weights, metrics = rollout_is_weights(OLD, ROLLOUT, MASK, level="token", threshold=2.0, batch_normalize=True)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 0.5, 1.2, 0.0], [2.0, 1.0, 0.0, 0.0]]) / 1.14)
    assert metric(metrics, "rollout_is_batch_norm_factor") == pytest.approx(1.14)
    assert metric(metrics, "rollout_is_mean") == pytest.approx(1.14)  # measured before normalizing


def test_batch_normalized_sequence_weights_average_one_per_sequence_not_per_token():
    weights, metrics = rollout_is_weights(
        OLD, ROLLOUT, MASK, level="sequence", threshold=10.0, batch_normalize=True
    )  # weights 0.6 (3 tokens) and 3.0 (2 tokens): the mean of sequences is 1.8, of tokens 1.56
    torch.testing.assert_close(weights, torch.tensor([[1 / 3] * 3 + [0.0], [5 / 3] * 2 + [0.0, 0.0]]))
    assert metric(metrics, "rollout_is_batch_norm_factor") == pytest.approx(1.8)


def test_weights_scale_each_tokens_loss():
    old = torch.zeros(1, 3)
    advantages = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    plain = loss_of(vanilla, old, old, advantages, mask).loss
    weighted = loss_of(vanilla, old, old, advantages, mask, weights=torch.tensor([[2.0, 0.0, 1.0]])).loss
    assert plain.item() == pytest.approx(-1.0)
    assert weighted.item() == pytest.approx(-1.0 * (2 + 0 + 1) / 3)
    assert math.isfinite(weighted.item())


# -- rejection sampling ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bounds", "kept"),
    [
        # k1 = -log r kept in [log 0.8, log 1.25]: r in [0.8, 1.25]
        ({"token_k1": (0.8, 1.25)}, [[1, 0, 1, 0], [0, 1, 0, 0]]),
        # verl bounds the statistic -log r, not r: [log 0.5, log 1.1] keeps r in [1/1.1, 2], so 0.5 goes, 1.2 stays
        ({"token_k1": (0.5, 1.1)}, [[1, 0, 1, 0], [0, 1, 0, 0]]),
        ({"token_k2": (None, 0.1)}, [[1, 0, 1, 0], [0, 1, 0, 0]]),  # (log r)^2 / 2: 0.24 and 0.60 go
        # sum of -log r: -log 0.6 = 0.51 is inside [log 0.5, log 2], -log 3 = -1.10 is not
        ({"seq_sum_k1": (0.5, 2.0)}, [[1, 1, 1, 0], [0, 0, 0, 0]]),
        ({"seq_mean_k3": (None, 0.1)}, [[1, 1, 1, 0], [0, 0, 0, 0]]),  # mean r - 1 - log r: 0.070 and 0.45
        ({"seq_max_k2": (None, 0.5)}, [[1, 1, 1, 0], [0, 0, 0, 0]]),  # max (log r)^2 / 2: 0.24 and 0.60
        ({"seq_max_k2": (None, 0.7)}, [[1, 1, 1, 0], [1, 1, 0, 0]]),
        # every option must pass: the token rejections of k2 and the sequence one of seq_sum_k1
        ({"token_k2": (None, 0.1), "seq_sum_k1": (0.5, 2.0)}, [[1, 0, 1, 0], [0, 0, 0, 0]]),
    ],
)
def test_rejection_masks_the_tokens_or_sequences_outside_the_bounds(bounds, kept):
    mask, metrics = rejection_mask(OLD, ROLLOUT, MASK, bounds)
    assert mask.tolist() == kept and mask.dtype == MASK.dtype
    rejected = 1 - torch.tensor(kept).sum().item() / 5
    assert metric(metrics, "rollout_rs_masked_fraction") == pytest.approx(rejected)
    rows_hit = (torch.tensor(kept) != MASK).any(-1).float().mean().item()  # rows that lost a token
    assert metric(metrics, "rollout_rs_seq_masked_fraction") == pytest.approx(rows_hit)


def test_rejection_metrics_per_option():
    _, metrics = rejection_mask(OLD, ROLLOUT, MASK, {"token_k1": (0.8, 1.25), "seq_mean_k3": (None, 0.1)})
    assert metric(metrics, "rollout_rs_token_k1_mean") == pytest.approx(-math.log(1.8) / 5, rel=1e-5)
    assert metric(metrics, "rollout_rs_token_k1_max") == pytest.approx(math.log(2), rel=1e-5)  # -log 0.5
    assert metric(metrics, "rollout_rs_token_k1_masked_fraction") == pytest.approx(2 / 5)
    assert metric(metrics, "rollout_rs_seq_mean_k3_seq_masked_fraction") == pytest.approx(1 / 2)
    k3 = [r - 1 - math.log(r) for r in RATIOS]
    assert metric(metrics, "rollout_rs_seq_mean_k3_max") == pytest.approx((k3[3] + k3[4]) / 2, rel=1e-5)


def test_offpolicy_metrics_are_verls():
    metrics = offpolicy_metrics(OLD, ROLLOUT, MASK)
    assert metric(metrics, "kl") == pytest.approx(-math.log(1.8) / 5, rel=1e-5)  # mean log rollout - log old
    assert metric(metrics, "k3_kl") == pytest.approx(sum(r - 1 - math.log(r) for r in RATIOS) / 5, rel=1e-5)
    assert metric(metrics, "chi2_token") == pytest.approx(sum(r * r for r in RATIOS) / 5 - 1, rel=1e-5)
    assert metric(metrics, "chi2_seq") == pytest.approx((0.6**2 + 3.0**2) / 2 - 1, rel=1e-5)
    assert metric(metrics, "rollout_ppl") == pytest.approx(2.25, rel=1e-5)  # both rows 1 / 0.5 and 1 / 0.4
    # a row's mean log-prob under the rollout less under the policy: the first row's is the larger
    assert metric(metrics, "log_ppl_diff_max") == pytest.approx(math.log(0.5) - math.log(0.5 * 0.25 * 0.6) / 3)


# -- the corrections in the losses -----------------------------------------------------------


def test_reinforce_is_the_policy_gradient_weighted_and_unclipped():
    log_prob = torch.log(torch.tensor([[0.5, 0.25, 0.9]])).requires_grad_(True)
    rollout = torch.log(torch.tensor([[0.25, 0.25, 0.3]]))
    advantages = torch.tensor([[1.0, -2.0, 1.0]])
    mask = torch.tensor([[1, 1, 0]])
    weights = torch.tensor([[2.0, 0.5, 1.0]])
    result = loss_of(reinforce, rollout, log_prob, advantages, mask, weights=weights)
    expected = (-1.0 * math.log(0.5) * 2.0 + 2.0 * math.log(0.25) * 0.5) / 2
    assert result.loss.item() == pytest.approx(expected)
    result.loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.0, 0.5, 0.0]]))  # -A w / 2 tokens
    assert "actor/pg_clipfrac" not in result.metrics
    assert result.metrics["actor/ppo_kl"] == pytest.approx((math.log(0.25 / 0.5) + 0.0) / 2)  # rollout - policy
    plain = loss_of(reinforce, rollout, log_prob, advantages, mask)
    assert plain.loss.item() == pytest.approx((-math.log(0.5) + 2.0 * math.log(0.25)) / 2)


def bypass(**settings) -> RolloutCorrection:
    correction = RolloutCorrection(bypass_mode=True, **settings)
    correction.check()
    return correction


PPO = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean"}


def test_bypass_reinforce_weights_by_policy_over_rollout_truncated():
    log_prob = OLD.clone().requires_grad_(True)  # the policy being trained; OLD / ROLLOUT as above
    advantages = torch.ones(2, 4)
    result, metrics = bypass_policy_loss(
        bypass(loss_type="reinforce", rollout_is="token"), ROLLOUT, log_prob, advantages, MASK, **PPO
    )
    weights = [1.0, 0.5, 1.2, 2.0, 1.0]
    log_probs = [math.log(p) for p in (0.5, 0.25, 0.6, 0.6, 0.8)]
    assert result.loss.item() == pytest.approx(-sum(w * lp for w, lp in zip(weights, log_probs, strict=True)) / 5)
    result.loss.backward()
    torch.testing.assert_close(log_prob.grad, -torch.tensor([[1.0, 0.5, 1.2, 0.0], [2.0, 1.0, 0.0, 0.0]]) / 5)
    assert metric(metrics, "rollout_is_mean") == pytest.approx(1.14)
    assert metric(metrics, "kl") == pytest.approx(-math.log(1.8) / 5, rel=1e-5)


def test_bypass_reinforce_without_rollout_is_is_plain_reinforce():
    result, metrics = bypass_policy_loss(bypass(loss_type="reinforce"), ROLLOUT, OLD, torch.ones(2, 4), MASK, **PPO)
    assert result.loss.item() == pytest.approx(loss_of(reinforce, ROLLOUT, OLD, torch.ones(2, 4), MASK).loss.item())
    assert not any("rollout_is_" in key for key in metrics) and "rollout_corr/chi2_token" in metrics


def test_bypass_ppo_clip_only_measures_the_weights():
    advantages = torch.tensor([[1.0] * 4, [-1.0] * 4])
    result, metrics = bypass_policy_loss(bypass(rollout_is="sequence"), ROLLOUT, OLD, advantages, MASK, **PPO)
    plain = loss_of(vanilla, ROLLOUT, OLD, advantages, MASK, **PPO)  # the ratio is already policy / rollout
    assert result.loss.item() == pytest.approx(plain.loss.item())
    clipfrac = "actor/pg_clipfrac"
    assert result.metrics[clipfrac] == plain.metrics[clipfrac] and "rollout_corr/rollout_is_mean" in metrics


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_rejected_tokens_add_nothing_yet_still_count_in_the_token_mean(loss_type):
    """verl divides by the mini-batch's tokens counted before its loss rejected any."""
    correction = bypass(loss_type=loss_type, rollout_rs="token_k1", rollout_rs_threshold=1.25)
    advantages = torch.ones(2, 4)
    result, metrics = bypass_policy_loss(correction, ROLLOUT, OLD, advantages, MASK, **PPO)
    kept = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0]])  # r in [0.8, 1.25]
    ratio = (OLD - ROLLOUT).exp().clamp(0.8, 1.2)  # PPO's, on the tokens kept
    per_token = -advantages * (OLD if loss_type == "reinforce" else ratio)
    assert result.loss.item() == pytest.approx((per_token * kept).sum().item() / 5)
    assert metric(metrics, "rollout_rs_masked_fraction") == pytest.approx(2 / 5)


def test_bypass_rejected_rows_still_count_in_the_mean_of_sequences():
    correction = bypass(loss_type="reinforce", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")
    ppo = {**PPO, "loss_agg_mode": "seq-mean-token-mean"}
    result, _ = bypass_policy_loss(correction, ROLLOUT, OLD, torch.ones(2, 4), MASK, **ppo)
    first_row = -(math.log(0.5) + math.log(0.25) + math.log(0.6)) / 3  # the second row is rejected
    assert result.loss.item() == pytest.approx(first_row / 2)


def test_decoupled_correction_rejects_before_the_advantages():
    """verl's order: weights and rejection after the old log-probs, before the advantages, which
    then leave the rejected tokens out (here a whole sequence)."""
    settings = correction_settings(rollout_is="token", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")
    phases = Phases(settings, actor=None, rewarder=None, overlapped=False)
    batch = padded_batch(ROWS[:2])
    width = batch.batch["responses"].shape[1]
    batch.batch["response_mask"] = torch.zeros(2, width, dtype=torch.long)
    batch.batch["response_mask"][:, :4] = MASK
    batch.batch["old_log_probs"] = torch.nn.functional.pad(OLD, (0, width - 4))
    batch.batch["rollout_log_probs"] = torch.nn.functional.pad(ROLLOUT, (0, width - 4))
    batch.batch["token_level_scores"] = torch.zeros(2, width)
    batch.batch["token_level_scores"][0, 2] = 1.0
    batch.non_tensor_batch["uid"] = np.array(["a", "b"], dtype=object)
    metrics = phases.compute_advantage(batch)
    assert batch.batch["response_mask"][:, :4].tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    assert batch.batch["advantages"][1].abs().sum() == 0
    assert batch.batch["rollout_is_weights"][0, :3].tolist() == pytest.approx([1.0, 0.5, 1.2])
    assert metric(metrics, "rollout_rs_seq_masked_fraction") == pytest.approx(0.5)


def test_an_optimal_token_baseline_under_bypass_mode_is_refused_before_the_first_step():
    settings = RunSettings.from_config(
        {
            "task": {"name": None},
            "actor": {"calculate_sum_pi_squared": True},
            "algorithm": {"adv_estimator": "optimal_token_baseline", "rollout_correction": {"bypass_mode": True}},
        }
    )
    with pytest.raises(ConfigError, match=r"^algorithm\.adv_estimator: optimal_token_baseline needs the old log-prob"):
        Phases(settings, actor=None, rewarder=None, overlapped=False)


def test_gdpo_gets_the_reward_functions_named_parts_from_the_batch():
    settings = RunSettings.from_config(
        {"task": {"name": None}, "algorithm": {"adv_estimator": "gdpo", "gdpo_reward_keys": ["acc", "format"]}}
    )
    phases = Phases(settings, actor=None, rewarder=None, overlapped=False)
    batch = padded_batch(ROWS[:3])
    mask = batch.batch["response_mask"]
    batch.batch["token_level_scores"] = torch.zeros(mask.shape)
    batch.non_tensor_batch["uid"] = np.array(["a", "a", "a"], dtype=object)
    batch.non_tensor_batch["acc"] = np.array([1.0, 0.0, 0.0])
    batch.non_tensor_batch["format"] = np.array([0.0, 0.0, 1.0])
    phases.compute_advantage(batch)
    per_row = [float(row[m.bool()][0]) for row, m in zip(batch.batch["advantages"], mask, strict=True)]
    assert per_row[0] > per_row[1] and per_row[2] > per_row[1]  # each part lifts its own row over the one with none
    del batch.non_tensor_batch["format"]
    with pytest.raises(ValueError, match=r"^algorithm\.gdpo_reward_keys: format not among what the reward function"):
        phases.compute_advantage(batch)


def test_the_policy_trains_bypass_reinforce_from_the_phases_settings(tiny_model_dir):
    config = ActorConfig(ppo_mini_batch_size=3, ppo_micro_batch_size=3, optim=Optim(lr=1e-3))
    worker = Policy(str(tiny_model_dir), config, samples_per_prompt=1, temperature=0.7)
    batch = padded_batch(ROWS)
    mask = batch.batch["response_mask"].float()
    log_prob = worker.compute_log_prob(batch).batch["old_log_probs"]
    batch.batch["old_log_probs"] = log_prob + 0.1 * mask  # the rollout's: ratio e^-0.1 on every token
    batch.batch["advantages"] = torch.tensor([1.0, -1.0, 0.5])[:, None] * mask
    batch.meta_info["rollout_correction"] = bypass(loss_type="reinforce", rollout_is="token")
    metrics = worker.update(batch)
    expected = (-batch.batch["advantages"] * log_prob * math.exp(-0.1) * mask).sum() / mask.sum()
    assert metrics["actor/pg_loss"] == pytest.approx(expected.item(), rel=1e-4)
    assert metrics["rollout_corr/kl"] == pytest.approx(0.1, rel=1e-4)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.1, rel=1e-4)
    assert "actor/pg_clipfrac" not in metrics  # reinforce clips nothing


def test_an_empty_batch_is_left_as_it_is():
    empty = torch.zeros_like(MASK)
    correction = bypass(rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=1.0)
    weights, mask, metrics = correct(correction, OLD, ROLLOUT, empty)
    assert weights is None and mask is empty and metrics == {}


# -- which settings verl accepts ---------------------------------------------------------------


def correction_settings(**correction) -> RunSettings:
    return RunSettings.from_config({"task": {"name": None}, "algorithm": {"rollout_correction": correction}})


# Every preset of verl's RolloutCorrectionConfig (verl/trainer/config/algorithm.py), and more it reads.
VERL_PRESETS = {
    "decoupled_token_is": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "decoupled_seq_is": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "decoupled_token_icepop": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
    "decoupled_seq_is_rs": {
        "rollout_is": "sequence", "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"
    },
    "decoupled_geo_rs": {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"},
    "bypass_ppo_clip": {"bypass_mode": True, "loss_type": "ppo_clip"},
    "bypass_ppo_clip_geo_rs": {"bypass_mode": True, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"},
    "bypass_ppo_clip_k3_rs": {"bypass_mode": True, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    "bypass_pg_is": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence"},
    "bypass_pg_token_icepop": {
        "bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "0.5_5.0"
    },
    "bypass_pg_geo_rs_token_tis": {
        "bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token",
        "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001",
    },
    "decoupled_k3_rs_seq_tis": {"rollout_is": "sequence", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    # verl's examples/rollout_correction: REINFORCE, sequence IS, batch-normalized
    "rloo_seq_is_pure": {
        "bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_batch_normalize": True
    },
    # ppo_clip with weights: verl measures them and applies none
    "bypass_ppo_clip_token_is": {"bypass_mode": True, "rollout_is": "token"},
    # loss_type matters only in bypass mode; verl ignores it otherwise
    "decoupled_reinforce": {"bypass_mode": False, "loss_type": "reinforce", "rollout_is": "token"},
    # a threshold verl never reads: no IS, no rejection
    "unread_thresholds": {"rollout_is_threshold": -1, "rollout_rs_threshold": "nonsense"},
    "no_is_threshold": {"rollout_is": "token", "rollout_is_threshold": None},
    # several options, duplicates dropped; one threshold for all, or one each; k1's alone is its upper bound
    "chained": {"rollout_rs": "token_k1, seq_max_k3,token_k1", "rollout_rs_threshold": "2.0, 0.5"},
    "one_threshold": {"rollout_rs": "token_k2,seq_mean_k3", "rollout_rs_threshold": 0.5},
}  # fmt: skip


@pytest.mark.parametrize("correction", VERL_PRESETS.values(), ids=VERL_PRESETS.keys())
def test_what_verl_accepts_is_accepted(correction):
    settings = correction_settings(**correction).algorithm.rollout_correction
    assert settings.model_dump(include=set(correction)) == correction


def test_k1_thresholds_read_as_verl_reads_them():
    settings = correction_settings(**VERL_PRESETS["chained"]).algorithm.rollout_correction
    assert settings.rs_bounds() == {"token_k1": (0.5, 2.0), "seq_max_k3": (None, 0.5)}


@pytest.mark.parametrize(
    ("correction", "message"),
    [
        ({"rollout_is": "tokens"}, r"^algorithm\.rollout_correction\.rollout_is: expected 'token' or 'sequence'"),
        ({"loss_type": "ppo"}, r"^algorithm\.rollout_correction\.loss_type: expected 'ppo_clip' or 'reinforce'"),
        ({"rollout_is": "token", "rollout_is_threshold": -1}, r"\.rollout_is_threshold: expected positive bounds"),
        ({"rollout_is": "token", "rollout_is_threshold": "2_1"}, r"\.rollout_is_threshold: lower bound above"),
        ({"rollout_is": "token", "rollout_is_threshold": True}, r"\.rollout_is_threshold: expected a positive number"),
        ({"rollout_is": "sequence", "rollout_is_threshold": "x"}, r"\.rollout_is_threshold: expected a positive"),
        ({"rollout_rs": "token_k4", "rollout_rs_threshold": 1}, r"^algorithm\.rollout_correction\.rollout_rs: unknown"),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2}, r"\.rollout_rs: unknown option 'seq_max_k1'"),
        ({"rollout_rs": ""}, r"\.rollout_rs: unknown option ''"),
        ({"rollout_rs": "token_k1"}, r"^algorithm\.rollout_correction\.rollout_rs_threshold: required with rollout_rs"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2"}, r"token_k2 takes an upper bound alone"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": 0.5}, r"0\.5 alone is an upper bound below .* token_k1$"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2_0.5"}, r"lower bound above the upper one in '2_0\.5'"),
        ({"rollout_rs": "token_k3", "rollout_rs_threshold": -0.1}, r"positive bounds, got -0\.1 for token_k3$"),
        ({"rollout_rs": "token_k1,seq_sum_k3", "rollout_rs_threshold": "1,2,3"}, r"3 thresholds for 2 rollout_rs"),
    ],
)
def test_what_verl_refuses_is_refused_in_one_line_naming_the_key(correction, message):
    with pytest.raises(ConfigError, match=message) as refused:
        correction_settings(**correction)
    assert "\n" not in str(refused.value)
