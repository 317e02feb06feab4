"""Rollout correction: truncated importance weights old / rollout, and their effect on the loss."""

import math

import pytest
import torch
from skip_plugin_trainer.train.algorithm import policy_loss
from skip_plugin_trainer.train.correction import rollout_is_weights

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
ROLLOUT = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.9], [0.2, 0.8, 0.9, 0.9]]))
OLD = torch.log(torch.tensor([[0.5, 0.25, 0.6, 0.1], [0.6, 0.8, 0.1, 0.1]]))


def test_token_weights_are_the_ratio_truncated_and_zero_on_padding():
    weights, metrics = rollout_is_weights(OLD, ROLLOUT, MASK, level="token", threshold=2.0)
    expected = torch.tensor([[1.0, 0.5, 1.2, 0.0], [2.0, 1.0, 0.0, 0.0]])  # 0.6 / 0.2 = 3 is truncated to 2
    torch.testing.assert_close(weights, expected)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(3.0)
    assert metrics["rollout_corr/rollout_is_truncated_frac"] == pytest.approx(1 / 5)


def test_sequence_weights_are_the_product_over_the_response():
    weights, _ = rollout_is_weights(OLD, ROLLOUT, MASK, level="sequence", threshold=10.0)
    first, second = 1.0 * 0.5 * 1.2, 3.0 * 1.0
    expected = torch.tensor([[first] * 3 + [0.0], [second] * 2 + [0.0, 0.0]])
    torch.testing.assert_close(weights, expected)


def test_weights_scale_each_tokens_loss():
    old = torch.zeros(1, 3)
    advantages = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    plain = policy_loss(old, old, advantages, mask).loss
    weighted = policy_loss(old, old, advantages, mask, weights=torch.tensor([[2.0, 0.0, 1.0]])).loss
    assert plain.item() == pytest.approx(-1.0)
    assert weighted.item() == pytest.approx(-1.0 * (2 + 0 + 1) / 3)
    assert math.isfinite(weighted.item())
