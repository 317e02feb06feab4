"""GAE and the value loss on hand-sized cases, and the critic worker in-process."""

import pytest
import torch
from batches import ROWS, padded_batch
from skip_plugin_trainer.algorithms.aggregation import LOSS_AGG_MODES, masked_whiten
from skip_plugin_trainer.algorithms.contract import AdvantageInputs
from skip_plugin_trainer.algorithms.token_advantages import gae
from skip_plugin_trainer.config.algorithm import AlgorithmConfig, CriticConfig, Optim
from skip_plugin_trainer.train.critic import Critic
from skip_plugin_trainer.train.value import value_loss, value_metrics


def gae_advantages(rewards, values, mask, gamma: float, lam: float):
    inputs = AdvantageInputs(rewards, mask, [str(i) for i in range(len(rewards))], values=values)
    return gae(inputs, AlgorithmConfig(adv_estimator="gae", gamma=gamma, lam=lam))


def test_gae_matches_the_recursion_worked_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.4, 0.8], [1.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    gamma, lam = 0.9, 0.8
    # Row 0, backwards: delta_2 = 1 - 0.8 = 0.2; delta_1 = 0.9 * 0.8 - 0.4 = 0.32;
    # delta_0 = 0.9 * 0.4 - 0.5 = -0.14. A_2 = 0.2, A_1 = 0.32 + 0.72 * 0.2 = 0.464,
    # A_0 = -0.14 + 0.72 * 0.464 = 0.19408. Row 1 ends at t = 1 (t = 2 is padding):
    # A_1 = 2 - 0.5 = 1.5, A_0 = 0.9 * 0.5 - 1 + 0.72 * 1.5 = 0.53.
    raw = torch.tensor([[0.19408, 0.464, 0.2], [0.53, 1.5, 0.0]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    assert returns == pytest.approx((raw + values) * mask, abs=1e-6)  # the critic's target: A + V
    assert advantages == pytest.approx(masked_whiten(raw, mask) * mask, abs=1e-6)


def test_a_token_off_the_mask_is_skipped_not_a_step():
    """A tool response inside an answer: the estimate carries across it unchanged."""
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 9.0, 0.6]])  # the masked value must play no part
    with_gap = gae_advantages(rewards, values, torch.tensor([[1, 0, 1]]), gamma=1.0, lam=1.0)[1]
    without = gae_advantages(rewards[:, [0, 2]], values[:, [0, 2]], torch.tensor([[1, 1]]), gamma=1.0, lam=1.0)[1]
    assert with_gap[0, [0, 2]] == pytest.approx(without[0]) and with_gap[0, 1] == 0


def test_the_value_loss_clips_a_prediction_that_moved_too_far():
    """Old value 0, return 1, clip range 0.5: a prediction may not buy loss by moving past 0.5."""
    returns, old, mask = torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.ones(1, 1)

    def loss(vpred: float):
        return value_loss(torch.tensor([[vpred]]), returns, old, mask, cliprange_value=0.5, loss_agg_mode="token-mean")

    near, far, away = loss(0.1), loss(0.9), loss(-1.0)
    assert near.loss.item() == pytest.approx(0.5 * 0.81) and near.clipfrac == 0
    assert far.loss.item() == pytest.approx(0.5 * 0.25) and far.clipfrac == 1  # as if it had stopped at 0.5
    assert away.loss.item() == pytest.approx(0.5 * 4.0) and away.clipfrac == 0  # moving away is paid in full


def test_value_metrics_read_only_the_loss_tokens():
    values, returns = torch.tensor([[1.0, 100.0]]), torch.tensor([[3.0, -100.0]])
    metrics = value_metrics(values, returns, torch.tensor([[1, 0]]))
    assert metrics["critic/values/max"] == 1.0 and metrics["critic/returns/min"] == 3.0


def critic(model_dir, **settings) -> Critic:
    config = CriticConfig(**{"ppo_mini_batch_size": 3, "ppo_micro_batch_size": 3, "optim": Optim(lr=1e-3), **settings})
    return Critic(str(model_dir), config, samples_per_prompt=1)


def test_values_lie_on_the_response_tokens_only(tiny_model_dir):
    batch = padded_batch(ROWS)
    values = critic(tiny_model_dir).compute_values(batch).batch["values"]
    mask = batch.batch["response_mask"].bool()
    assert values.shape == mask.shape and (values[~mask] == 0).all() and (values[mask] != 0).all()


def test_a_critic_fitting_a_fixed_batch_lowers_its_loss(tiny_model_dir):
    worker = critic(tiny_model_dir, cliprange_value=10.0, optim=Optim(lr=1e-4))
    batch = padded_batch(ROWS)
    batch.batch["returns"] = torch.tensor([1.0, -1.0, 0.5])[:, None] * batch.batch["response_mask"]
    losses = []
    for _ in range(10):
        batch.batch["values"] = worker.compute_values(batch).batch["values"]
        losses.append(worker.update(batch)["critic/vf_loss"])
    assert max(losses[-3:]) < 0.5 * losses[0]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_accumulate_to_the_same_update(tiny_model_dir, mode):
    """Each micro-batch's loss is its part of the whole mini-batch's (``Totals``), so in every mode
    three micro-batches of one row of ragged length accumulate the gradient one micro-batch of
    three computes (it stays on the parameters after the step), and report the same loss."""
    batch = padded_batch(ROWS)
    batch.batch["returns"] = torch.tensor([1.0, -1.0, 0.5])[:, None] * batch.batch["response_mask"]
    whole = critic(tiny_model_dir, loss_agg_mode=mode)
    split = critic(tiny_model_dir, loss_agg_mode=mode, ppo_micro_batch_size=1)
    batch.batch["values"] = whole.compute_values(batch).batch["values"]
    whole_metrics, split_metrics = whole.update(batch), split.update(batch)
    assert whole_metrics["critic/grad_norm"] == pytest.approx(split_metrics["critic/grad_norm"], rel=1e-5)
    assert whole_metrics["critic/grad_norm"] > 0
    assert whole_metrics["critic/vf_loss"] == pytest.approx(split_metrics["critic/vf_loss"], rel=1e-5)
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)


def test_predictions_inside_the_clip_range_are_never_counted_as_clipped():
    """verl clamps the prediction between its bounds, so one inside them is itself. Computed as
    values + (vpreds - values) it differs from vpreds by a rounding wherever the two are of other
    signs or magnitudes (a critic's early estimates: these are a real run's ranges), and each such
    token rounded away from its return counted as clipped."""
    generator = torch.Generator().manual_seed(0)
    values = -0.06 + 0.02 * torch.randn(64, 64, generator=generator)
    vpreds = 0.03 * torch.randn(64, 64, generator=generator)  # well inside +-0.5 of the values
    returns = torch.randn(64, 64, generator=generator)
    result = value_loss(vpreds, returns, values, torch.ones(64, 64), cliprange_value=0.5, loss_agg_mode="token-mean")
    assert result.clipfrac == 0
    assert result.loss.item() == pytest.approx(0.5 * ((vpreds - returns) ** 2).mean().item())
