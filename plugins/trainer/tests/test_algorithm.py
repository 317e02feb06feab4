"""The RL math against values worked out by hand in the comments: masked statistics, loss
aggregation, PPO's clipped loss, KL penalties, log-probs. (Every loss and estimator is also
checked against verl's own function: plugins/verl/tests/in_verl.)"""

import itertools
import math

import pytest
import torch
from skip_plugin_trainer.algorithms.aggregation import LOSS_AGG_MODES, Totals, agg_loss, masked_mean, masked_whiten
from skip_plugin_trainer.algorithms.contract import LossContext, LossInputs, PolicyLoss
from skip_plugin_trainer.algorithms.kl import KL_PENALTIES, apply_kl_penalty, kl_penalty
from skip_plugin_trainer.algorithms.losses import vanilla
from skip_plugin_trainer.config.algorithm import ActorConfig
from skip_plugin_trainer.train.logits import entropy_from_logits, log_probs_from_logits
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


# ---------------------------------------------------------------- loss aggregation

LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7.0 / 3),  # (1 + 2 + 4) / 3
        ("token-sum", 7.0),
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2
        ("seq-mean-token-sum-norm", 3.5 / 3),
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
    ],
)
def test_agg_loss_ragged_mask(mode, expected):
    assert_close(agg_loss(LOSS, T([[1, 1, 0], [1, 0, 0]]), mode), T(expected))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 1.5),  # (1 + 2) / 2
        ("token-sum", 3.0),
        ("seq-mean-token-sum", 1.5),  # (3 + 0) / 2: the empty row counts, as in verl's trainer
        ("seq-mean-token-sum-norm", 0.5),  # 1.5 / 3, the response width
        ("seq-mean-token-mean", 0.75),  # (1.5 + 0) / 2
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
    assert totals == Totals(tokens=7.0, rows=5.0)
    whole = agg_loss(loss_mat, mask, mode)
    (whole_grad,) = torch.autograd.grad(whole, loss_mat)

    bounds = [0, *cuts, 5]
    parts = [agg_loss(loss_mat[a:b], mask[a:b], mode, totals) for a, b in itertools.pairwise(bounds)]
    (parts_grad,) = torch.autograd.grad(sum(parts), loss_mat)
    assert_close(sum(parts), whole)
    assert_close(parts_grad, whole_grad)
    if cuts == (2, 4):  # rows 2 (empty) and 3 (10 + 11 + 12 = 33 over 3 tokens), by hand
        expected = {
            "token-mean": 33 / 7,
            "token-sum": 33.0,
            "seq-mean-token-sum": 33 / 5,
            "seq-mean-token-sum-norm": 33 / 5 / 3,
            "seq-mean-token-mean": 11 / 5,
        }
        assert_close(parts[1], T(expected[mode]))


def test_a_part_normalised_by_itself_is_not_its_share_of_the_whole():
    """Why ``totals`` exists: a micro-batch's own mean weighs its tokens as if it were the whole."""
    loss_mat, mask = LOSS, T([[1, 1, 0], [1, 0, 0]])
    whole = agg_loss(loss_mat, mask, "token-mean")
    own = agg_loss(loss_mat[:1], mask[:1], "token-mean") + agg_loss(loss_mat[1:], mask[1:], "token-mean")
    assert not torch.isclose(own, whole)  # (1.5 + 4) != 7 / 3


# ---------------------------------------------------------------- policy loss


def _loss(old, new, advantages, mask, **actor) -> tuple[PolicyLoss, torch.Tensor]:
    log_prob = T(new).requires_grad_()
    result = vanilla(
        LossInputs(T(old), log_prob, T(advantages), T(mask)),
        LossContext(ActorConfig(**actor), Totals.of(T(mask)), T(mask)),
    )
    result.loss.backward()
    return result, log_prob.grad


def test_policy_loss_at_ratio_one_is_minus_mean_advantage():
    log_probs = [[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]]
    result, _ = _loss(log_probs, log_probs, [[1.0, -2.0, 3.0], [0.5, 7.0, 0.0]], [[1, 1, 1], [1, 0, 0]])
    assert_close(result.loss, T(-0.625))  # -(1 - 2 + 3 + 0.5) / 4
    assert result.metrics == {"actor/ppo_kl": 0.0, "actor/pg_clipfrac": 0.0, "actor/pg_clipfrac_lower": 0.0}


def test_approx_kl_is_mean_of_old_minus_new():
    result, _ = _loss([[0.0, 0.0, 0.0]], [[0.1, -0.3, 5.0]], [[1.0, 1.0, 1.0]], [[1, 1, 0]])
    assert result.metrics["actor/ppo_kl"] == pytest.approx(0.1)  # (-0.1 + 0.3) / 2


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
    assert result.metrics["actor/pg_clipfrac"] == 1.0
    assert (grad == 0).all()


def test_dual_clip_caps_negative_advantage_loss():
    # ratio e^2 ~ 7.389, A = -1: unclipped 7.389, clipped 1.2, max 7.389, capped at -A * c = 3.
    result, grad = _loss([[0.0]], [[2.0]], [[-1.0]], [[1]], clip_ratio_c=3.0)
    assert_close(result.loss, T(3.0))
    assert result.metrics["actor/pg_clipfrac_lower"] == 1.0
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
        (lambda: agg_loss(LOSS, torch.ones(2, 3), "seq-sum"), LOSS_AGG_MODES),
        (lambda: kl_penalty(LOG_PROB, REF_LOG_PROB, "k4"), (*KL_PENALTIES, "k1", "k2", "k3")),
        (lambda: ActorConfig(loss_agg_mode="sum"), LOSS_AGG_MODES),
    ],
)
def test_unknown_names_list_the_allowed_ones(call, allowed):
    with pytest.raises(ValueError) as error:
        call()
    for name in allowed:
        assert name in str(error.value)
