"""The RL math against values worked out by hand in the comments."""

import itertools
import math

import numpy as np
import pytest
import torch
from skip_plugin_trainer.train.algorithm import (
    ADVANTAGE_ESTIMATORS,
    KL_PENALTIES,
    LOSS_AGG_MODES,
    PolicyLoss,
    Totals,
    agg_loss,
    apply_kl_penalty,
    compute_advantages,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    log_probs_from_logits,
    masked_mean,
    masked_whiten,
    policy_loss,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from torch.testing import assert_close

T = torch.tensor


# ---------------------------------------------------------------- masked statistics


def test_masked_mean_ignores_masked_entries_and_empty_mask_is_zero():
    values = T([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    assert_close(masked_mean(values, mask), T(7.0 / 3))  # (1 + 2 + 4) / 3
    assert_close(masked_mean(values, mask, dim=-1), T([1.5, 4.0]))
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_masked_whiten_uses_unbiased_variance_over_the_mask():
    values = T([[1.0, 3.0, 50.0]])
    mask = T([[1, 1, 0]])
    # mean 2, deviations -1 and 1, unbiased variance (1 + 1) / (2 - 1) = 2
    expected = T([[-1.0, 1.0, 48.0]]) / math.sqrt(2)
    assert_close(masked_whiten(values, mask)[:, :2], expected[:, :2])
    assert_close(masked_whiten(values, mask, shift_mean=False)[:, :2], expected[:, :2] + 2)
    with pytest.raises(ValueError, match="two"):
        masked_whiten(values, T([[1, 0, 0]]))


# ---------------------------------------------------------------- advantages

# Rows of groups a (3 samples), b (a singleton) and c (2 equal scores), interleaved.
GROUP_INDEX = ["a", "b", "a", "c", "a", "c"]
GROUP_REWARDS = T(
    [
        [0.0, 0.0, 0.0],  # a: score 0
        [1.0, 2.0, 0.0],  # b: score 3
        [1.0, 0.0, 1.0],  # a: score 2
        [0.5, 0.0, 0.0],  # c: score 0.5
        [0.0, 4.0, 0.0],  # a: score 4
        [0.0, 0.0, 0.5],  # c: score 0.5
    ]
)
GROUP_MASK = T(
    [
        [1, 1, 0],
        [1, 1, 0],
        [1, 0, 1],
        [1, 0, 0],
        [1, 1, 0],
        [1, 1, 1],
    ]
)


def test_grpo_normalised_by_std():
    # a: mean 2, unbiased std sqrt((4 + 0 + 4) / 2) = 2 -> advantages -1, 0, 1
    # b: singleton, mean 0 and std 1 -> 3;  c: std 0 -> (0.5 - 0.5) / (0 + eps) = 0
    advantages, returns = grpo_advantages(GROUP_REWARDS, GROUP_MASK, np.array(GROUP_INDEX, dtype=object))
    expected = T(
        [
            [-1.0, -1.0, 0.0],
            [3.0, 3.0, 0.0],
            [0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0],
            [1.0, 1.0, 0.0],
            [0.0, 0.0, 0.0],
        ]
    )
    assert_close(advantages, expected, atol=1e-5, rtol=0)
    assert torch.isfinite(advantages).all()
    assert torch.equal(returns, advantages)


def test_grpo_without_std_normalisation():
    # a: scores 0, 2, 4 minus mean 2 -> -2, 0, 2;  b: 3 - 0;  c: 0
    advantages, _ = compute_advantages("grpo", GROUP_REWARDS, GROUP_MASK, GROUP_INDEX, norm_adv_by_std_in_grpo=False)
    per_row = T([-2.0, 3.0, 0.0, 0.0, 2.0, 0.0])
    assert_close(advantages, per_row[:, None] * GROUP_MASK)


def test_grpo_is_zero_off_the_mask_and_constant_over_loss_tokens():
    advantages, _ = compute_advantages("grpo", GROUP_REWARDS, GROUP_MASK, GROUP_INDEX)
    assert (advantages[GROUP_MASK == 0] == 0).all()
    for row, mask in zip(advantages, GROUP_MASK, strict=True):
        loss_values = row[mask == 1]
        assert (loss_values == loss_values[0]).all()


def test_rloo_leave_one_out():
    rewards = T([[0.0, 1.0], [2.0, 0.0], [4.0, 0.0], [0.0, 6.0]])
    mask = T([[1, 1], [1, 0], [1, 1], [1, 1]])
    index = ["g", "g", "solo", "g"]
    # g scores 1, 2, 6: 1 - (2 + 6) / 2 = -3;  2 - (1 + 6) / 2 = -1.5;  6 - (1 + 2) / 2 = 4.5
    # solo: baseline 0 -> 4
    advantages, returns = rloo_advantages(rewards, mask, index)
    assert_close(advantages, T([[-3.0, -3.0], [-1.5, 0.0], [4.0, 4.0], [4.5, 4.5]]))
    assert torch.equal(returns, advantages)


def test_reinforce_plus_plus_discounted_returns_and_whitening():
    rewards = T([[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 4.0, 0.0]])
    mask = T([[1, 1, 0, 1], [1, 1, 1, 0]])
    # gamma 0.5, right to left. Row 0: t3: 2;  t2: 0 + 0.5 * 2 = 1, then cut by mask 0;
    # t1: 1 + 0.5 * 0 = 1;  t0: 0 + 0.5 * 1 = 0.5.  Row 1: t3: 0;  t2: 4;  t1: 2;  t0: 1.
    advantages, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    assert_close(returns, T([[0.5, 1.0, 0.0, 2.0], [1.0, 2.0, 4.0, 0.0]]))
    # Loss-token returns 0.5, 1, 2, 1, 2, 4: mean 10.5 / 6 = 1.75; squared deviations
    # 1.5625 + 0.5625 + 0.0625 + 0.5625 + 0.0625 + 5.0625 = 7.875; unbiased variance 7.875 / 5 = 1.575.
    deviations = T([[-1.25, -0.75, 0.0, 0.25], [-0.75, 0.25, 2.25, 0.0]])
    assert_close(advantages, deviations / math.sqrt(1.575))
    assert abs(masked_mean(advantages, mask).item()) < 1e-6


def test_compute_advantages_dispatches_by_name():
    advantages, _ = compute_advantages("rloo", T([[1.0], [3.0]]), T([[1], [1]]), ["u", "u"])
    assert_close(advantages, T([[-2.0], [2.0]]))  # 1 - 3 and 3 - 1
    _, returns = compute_advantages("reinforce_plus_plus", T([[1.0, 1.0]]), T([[1, 1]]), ["u"], gamma=0.5)
    assert_close(returns, T([[1.5, 1.0]]))  # 1 + 0.5 * 1


def test_index_must_cover_every_row():
    with pytest.raises(ValueError, match="index"):
        grpo_advantages(GROUP_REWARDS, GROUP_MASK, GROUP_INDEX[:-1])


# ---------------------------------------------------------------- loss aggregation

LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7.0 / 3),  # (1 + 2 + 4) / 3
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
    ],
)
def test_agg_loss_ragged_mask(mode, expected):
    assert_close(agg_loss(LOSS, T([[1, 1, 0], [1, 0, 0]]), mode), T(expected))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 1.5),  # (1 + 2) / 2
        ("seq-mean-token-sum", 1.5),  # (3 + 0) / 2: the empty row counts
        ("seq-mean-token-mean", 1.5),  # 1.5 / 1: the empty row does not count
    ],
)
def test_agg_loss_with_an_empty_row(mode, expected):
    assert_close(agg_loss(LOSS, T([[1, 1, 0], [0, 0, 0]]), mode), T(expected))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_with_no_loss_tokens_is_zero_with_finite_gradient(mode):
    loss_mat = LOSS.clone().requires_grad_()
    loss = agg_loss(loss_mat, torch.zeros(2, 3), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert (loss_mat.grad == 0).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("cuts", [(1, 2, 3), (2, 4), (3,), (4,)], ids=str)
def test_agg_loss_of_the_parts_with_the_wholes_totals_adds_up_to_the_wholes(mode, cuts):
    """Micro-batches (and ranks) each aggregate their rows against the mini-batch's ``Totals``:
    their losses, and so their gradients, add up to the whole mini-batch's however it is cut,
    including a part whose only row has no loss token."""
    loss_mat = torch.arange(1.0, 16.0).reshape(5, 3).requires_grad_()
    mask = T([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1], [0, 1, 0]])  # ragged, row 2 empty
    totals = Totals.of(mask)
    assert totals == Totals(tokens=7.0, rows=5.0, rows_with_tokens=4.0)
    whole = agg_loss(loss_mat, mask, mode)
    (whole_grad,) = torch.autograd.grad(whole, loss_mat)

    bounds = [0, *cuts, 5]
    parts = [agg_loss(loss_mat[a:b], mask[a:b], mode, totals) for a, b in itertools.pairwise(bounds)]
    (parts_grad,) = torch.autograd.grad(sum(parts), loss_mat)
    assert_close(sum(parts), whole)
    assert_close(parts_grad, whole_grad)
    if cuts == (2, 4):  # rows 2 (empty) and 3 (10 + 11 + 12 = 33 over 3 tokens), by hand
        expected = {"token-mean": 33 / 7, "seq-mean-token-sum": 33 / 5, "seq-mean-token-mean": 11 / 4}
        assert_close(parts[1], T(expected[mode]))


def test_a_part_normalised_by_itself_is_not_its_share_of_the_whole():
    """Why ``totals`` exists: a micro-batch's own mean weighs its tokens as if it were the whole."""
    loss_mat, mask = LOSS, T([[1, 1, 0], [1, 0, 0]])
    whole = agg_loss(loss_mat, mask, "token-mean")
    own = agg_loss(loss_mat[:1], mask[:1], "token-mean") + agg_loss(loss_mat[1:], mask[1:], "token-mean")
    assert not torch.isclose(own, whole)  # (1.5 + 4) != 7 / 3


# ---------------------------------------------------------------- policy loss


def _loss(old, new, advantages, mask, **kwargs) -> tuple[PolicyLoss, torch.Tensor]:
    log_prob = T(new).requires_grad_()
    result = policy_loss(T(old), log_prob, T(advantages), T(mask), **kwargs)
    result.loss.backward()
    return result, log_prob.grad


def test_policy_loss_at_ratio_one_is_minus_mean_advantage():
    log_probs = [[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]]
    result, _ = _loss(log_probs, log_probs, [[1.0, -2.0, 3.0], [0.5, 7.0, 0.0]], [[1, 1, 1], [1, 0, 0]])
    assert_close(result.loss, T(-0.625))  # -(1 - 2 + 3 + 0.5) / 4
    assert result.clipfrac == 0.0
    assert result.approx_kl == 0.0


def test_approx_kl_is_mean_of_old_minus_new():
    result, _ = _loss([[0.0, 0.0, 0.0]], [[0.1, -0.3, 5.0]], [[1.0, 1.0, 1.0]], [[1, 1, 0]])
    assert result.approx_kl == pytest.approx(0.1)  # (-0.1 + 0.3) / 2


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_policy_gradient_sign_follows_the_advantage(sign):
    # d(-A * ratio / 3) / d log_prob = -A / 3 at ratio 1 on each of the 3 loss tokens, 0 elsewhere.
    zeros = [[0.0, 0.0], [0.0, 0.0]]
    _, grad = _loss(zeros, zeros, [[sign, sign], [sign, sign]], [[1, 1], [1, 0]])
    assert_close(grad, T([[-sign / 3, -sign / 3], [-sign / 3, 0.0]]))


def test_clipped_ratio_gives_no_gradient():
    # ratio 1.5 > 1.2, A = 2: unclipped -3, clipped -2.4, max -2.4, which is constant in log_prob.
    result, grad = _loss([[0.0]], [[math.log(1.5)]], [[2.0]], [[1]])
    assert_close(result.loss, T(-2.4))
    assert result.clipfrac == 1.0
    assert (grad == 0).all()


def test_dual_clip_caps_negative_advantage_loss():
    # ratio e^2 ~ 7.389, A = -1: unclipped 7.389, clipped 1.2, max 7.389, capped at -A * c = 3.
    result, grad = _loss([[0.0]], [[2.0]], [[-1.0]], [[1]], clip_ratio_c=3.0)
    assert_close(result.loss, T(3.0))
    assert (grad == 0).all()
    uncapped, _ = _loss([[0.0]], [[2.0]], [[-1.0]], [[1]], clip_ratio_c=None)
    assert_close(uncapped.loss, T(math.exp(2)))


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        _loss([[0.0]], [[0.0]], [[1.0]], [[1]], clip_ratio_c=1.0)


def test_policy_loss_uses_the_aggregation_mode():
    # ratio 1: per-token losses -1, -1 | -4; seq-mean-token-sum: (-2 + -4) / 2 = -3
    zeros = [[0.0, 0.0], [0.0, 0.0]]
    result, _ = _loss(zeros, zeros, [[1.0, 1.0], [4.0, 9.0]], [[1, 1], [1, 0]], loss_agg_mode="seq-mean-token-sum")
    assert_close(result.loss, T(-3.0))


# ---------------------------------------------------------------- KL


LOG_PROB = T([[0.0, -1.0]])
REF_LOG_PROB = T([[-1.0, 0.0]])  # log_prob - ref = [1, -1]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("kl", [1.0, -1.0]),
        ("abs", [1.0, 1.0]),
        ("mse", [0.5, 0.5]),  # 0.5 * (+-1)^2
        ("low_var_kl", [math.exp(-1), math.e - 2]),  # d = ref - lp = [-1, 1]: e^-1 + 1 - 1, e^1 - 1 - 1
    ],
)
def test_kl_penalty_modes(mode, expected):
    assert_close(kl_penalty(LOG_PROB, REF_LOG_PROB, mode), T([expected]))


@pytest.mark.parametrize(("alias", "mode"), [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_penalty_aliases(alias, mode):
    assert torch.equal(kl_penalty(LOG_PROB, REF_LOG_PROB, alias), kl_penalty(LOG_PROB, REF_LOG_PROB, mode))


def test_low_var_kl_is_non_negative_and_clamped():
    generator = torch.Generator().manual_seed(0)
    log_prob, ref = torch.randn(4, 16, generator=generator), torch.randn(4, 16, generator=generator)
    assert (kl_penalty(log_prob, ref, "low_var_kl") >= 0).all()
    # d = 15: e^15 - 16 is far above 10; d = 100 would overflow exp without the inner clamp.
    assert_close(kl_penalty(T([[0.0, 0.0]]), T([[15.0, 100.0]]), "k3"), T([[10.0, 10.0]]))


def test_apply_kl_penalty():
    scores = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    log_prob = T([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    rewards, kl = apply_kl_penalty(scores, mask, log_prob, torch.zeros(2, 3), coef=0.5, mode="kl")
    # scores - 0.5 * kl on the mask: 0 - 0.05, 0 - 0.1, 1 - 0.15 | 0 - 0.2, 2 - 0.25, 0 (masked)
    assert_close(rewards, T([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]]))
    assert kl == pytest.approx(0.325)  # row means 0.2 and 0.45, averaged


# ---------------------------------------------------------------- logits


def test_log_probs_from_logits():
    # softmax([0, ln 3]) = [1/4, 3/4]
    logits = T([[[0.0, math.log(3)], [0.0, math.log(3)]]])
    assert_close(log_probs_from_logits(logits, T([[0, 1]])), T([[math.log(0.25), math.log(0.75)]]))


def test_log_probs_and_entropy_stay_finite_for_large_logits():
    # softmax([1000, 1000]) = [1/2, 1/2], where a naive exp overflows; float32 spacing at 1000 is 6e-5.
    logits = T([[[1000.0, 1000.0]]])
    assert_close(log_probs_from_logits(logits, T([[1]])), T([[math.log(0.5)]]), atol=1e-4, rtol=0)
    assert_close(entropy_from_logits(logits), T([[math.log(2)]]), atol=1e-4, rtol=0)


def test_log_probs_from_logits_computes_in_float32():
    logits = T([[[0.0, math.log(3)]]], dtype=torch.bfloat16)
    assert log_probs_from_logits(logits, T([[1]])).dtype == torch.float32


def test_entropy_from_logits():
    uniform = torch.full((1, 2, 5), 7.0)
    assert_close(entropy_from_logits(uniform), torch.full((1, 2), math.log(5)))
    # p = [1/4, 3/4]: -(0.25 ln 0.25 + 0.75 ln 0.75) ~ 0.5623
    skewed = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert_close(entropy_from_logits(T([[[0.0, math.log(3)]]])), T([[skewed]]))


# ---------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("call", "allowed"),
    [
        (lambda: compute_advantages("gae", GROUP_REWARDS, GROUP_MASK, GROUP_INDEX), ADVANTAGE_ESTIMATORS),
        (lambda: agg_loss(LOSS, torch.ones(2, 3), "seq-sum"), LOSS_AGG_MODES),
        (lambda: kl_penalty(LOG_PROB, REF_LOG_PROB, "k4"), (*KL_PENALTIES, "k1", "k2", "k3")),
        (lambda: policy_loss(LOG_PROB, LOG_PROB, LOG_PROB, T([[1, 1]]), loss_agg_mode="sum"), LOSS_AGG_MODES),
    ],
)
def test_unknown_names_list_the_allowed_ones(call, allowed):
    with pytest.raises(ValueError) as error:
        call()
    for name in allowed:
        assert name in str(error.value)
