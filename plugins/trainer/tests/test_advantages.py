"""The advantage estimators against values worked out by hand in the comments, and properties
that set them apart (RLOO's baseline leaves the row out, GDPO's parts are normalised apart, the
optimal token baseline weighs rows by their gradient's size). Every one is also checked against
verl's own function on random batches: plugins/verl/tests/in_verl/test_advantages_match_verl.py."""

import math

import pytest
import torch
from skip_plugin_trainer.algorithms.advantages import ESTIMATORS
from skip_plugin_trainer.algorithms.contract import AdvantageInputs
from skip_plugin_trainer.config.algorithm import AlgorithmConfig
from torch.testing import assert_close

T = torch.tensor
EST = {estimator.name: estimator for estimator in ESTIMATORS}
EPS = 1e-6


def run(name: str, rewards, mask, index, config: AlgorithmConfig | None = None, **optional):
    inputs = AdvantageInputs(T(rewards), T(mask), index, **optional)
    return EST[name].compute(inputs, config or AlgorithmConfig(adv_estimator=name))


def outcome(scores: list[float], width: int = 2) -> list[list[float]]:
    """One reward per response, on its last token."""
    return [[0.0] * (width - 1) + [score] for score in scores]


def test_fourteen_estimators_by_verls_names_with_what_they_need():
    assert len(EST) == len(ESTIMATORS) == 14
    assert EST["gae"].needs == {"values"}
    assert EST["remax"].needs == {"reward_baselines"}
    assert EST["gdpo"].needs == {"scores"}
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        assert EST[name].needs == {"old_log_probs", "sum_pi_squared", "rollout_is_weights"}
    assert not EST["grpo"].needs and not EST["rloo"].needs


# ---------------------------------------------------------------- group estimators


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized"])
def test_grpo_by_hand_with_interleaved_groups_a_response_alone_and_a_tool_gap(name):
    # group a: scores 1 and 3, mean 2, unbiased std sqrt(2); group b: 5 alone, mean 0 and std 1
    mask = [[1, 0, 1], [1, 1, 1], [1, 1, 0]]
    advantages, returns = run(name, outcome([1, 5, 3], 3), mask, ["a", "b", "a"])
    a = 1 / (math.sqrt(2) + EPS)
    assert_close(advantages, T([[-a, 0, -a], [5 / (1 + EPS)] * 3, [a, a, 0]]))
    assert returns is advantages or torch.equal(returns, advantages)
    plain, _ = run(name, outcome([1, 5, 3], 3), mask, ["a", "b", "a"], AlgorithmConfig(norm_adv_by_std_in_grpo=False))
    assert_close(plain, T([[-1.0, 0, -1], [5, 5, 5], [1, 1, 0]]))  # Dr.GRPO: centred only


@pytest.mark.parametrize(
    "name", ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg", "reinforce_plus_plus_baseline"]
)
def test_equal_rewards_in_every_group_teach_nothing(name):
    # 0.5 and 1 add up exactly, so the group's std is 0, not rounding noise
    advantages, _ = run(name, outcome([0.5] * 4 + [1.0] * 3), [[1, 1]] * 7, ["a"] * 4 + ["b"] * 3)
    assert not advantages.any()


def test_rloo_baselines_each_response_with_the_others_only():
    # group [1, 2, 6]: 1 - (2 + 6) / 2 = -3, 2 - (1 + 6) / 2 = -1.5, 6 - (1 + 2) / 2 = 4.5
    advantages, _ = run("rloo", outcome([1, 2, 6, 4]), [[1, 1]] * 4, ["g", "g", "g", "alone"])
    assert_close(advantages[:, -1], T([-3.0, -1.5, 4.5, 4.0]))  # a response alone keeps its score
    vectorized, _ = run("rloo_vectorized", outcome([1, 2, 6, 4]), [[1, 1]] * 4, ["g", "g", "g", "alone"])
    assert_close(vectorized[:, -1], T([-3.0, -1.5, 4.5, 0.0]))  # verl's vectorized one gives it 0
    # raising a row's own score by 3 raises its advantage by 3 (its baseline does not see it)
    # and lowers each peer's by 3 / (n - 1)
    raised, _ = run("rloo", outcome([4, 2, 6, 4]), [[1, 1]] * 4, ["g", "g", "g", "alone"])
    assert_close(raised[:, -1] - advantages[:, -1], T([3.0, -1.5, -1.5, 0.0]))


def test_grpo_passk_credits_only_a_groups_unique_best():
    # group a: best 0.9 leads 0.5 by 0.4; group b ties for best: nobody is credited
    scores = [0.2, 0.9, 0.5, 1.0, 1.0, 0.0]
    index = ["a", "a", "a", "b", "b", "b"]
    config = AlgorithmConfig(norm_adv_by_std_in_grpo=False)
    advantages, _ = run("grpo_passk", outcome(scores), [[1, 1]] * 6, index, config)
    assert_close(advantages[:, -1], T([0.0, 0.4, 0.0, 0.0, 0.0, 0.0]))
    normed, _ = run("grpo_passk", outcome(scores), [[1, 1]] * 6, index)
    assert_close(normed[1, -1], T(0.4) / (torch.std(T([0.2, 0.9, 0.5])) + EPS))
    with pytest.raises(ValueError, match="at least 2"):
        run("grpo_passk", outcome([1.0, 0.0, 1.0]), [[1, 1]] * 3, ["a", "a", "alone"])


def test_opo_weighs_the_baseline_by_response_length():
    # lengths 1 and 3, scores 1 and 0: baseline (1 x 1 + 3 x 0) / 4 = 0.25
    advantages, _ = run("opo", [[0, 0, 1.0], [0, 0, 0]], [[1, 0, 0], [1, 1, 1]], ["g", "g"])
    assert_close(advantages, T([[0.75, 0, 0], [-0.25, -0.25, -0.25]]))
    # a group with no loss token at all: 0, where verl's 0 / 0 gives NaN
    empty, _ = run("opo", [[1.0, 0], [0.5, 0]], [[0, 0], [0, 0]], ["g", "g"])
    assert torch.equal(empty, torch.zeros(2, 2))


def test_gpg_scales_by_batch_size_over_responses_with_a_reward():
    # 4 responses, 1 with a nonzero score: alpha 4; group a [1, 0] has mean 0.5
    advantages, _ = run("gpg", outcome([1, 0, 0, 0]), [[1, 1]] * 4, ["a", "a", "b", "b"])
    assert_close(advantages[:, -1], T([2.0, -2.0, 0.0, 0.0]))


def test_reinforce_plus_plus_baseline_whitens_over_the_batch_not_the_group():
    # centred scores 1, -1 (group a) and 3, -3 (group b): whitening over all tokens keeps b's larger
    advantages, _ = run("reinforce_plus_plus_baseline", outcome([1, -1, 3, -3]), [[1, 1]] * 4, ["a", "a", "b", "b"])
    std = torch.std(T([1.0, -1, 3, -3]).repeat_interleave(2))
    assert_close(advantages[:, 0], T([1.0, -1, 3, -3]) / std)


def test_gdpo_normalises_each_reward_part_apart():
    index = ["a", "a", "b", "b"]
    config = AlgorithmConfig(adv_estimator="gdpo", gdpo_reward_keys=("format", "accuracy"))
    parts = {"format": T([1.0, 0.0, 0.0, 1.0]), "accuracy": T([0.0, 1.0, 1.0, 1.0])}
    advantages, _ = run("gdpo", outcome([0] * 4), [[1, 1]] * 4, index, config, scores=parts)
    # format: +-a in both groups, a = 0.5 / (std 0.5 sqrt2 + eps); accuracy: -+a in a, 0 in b
    # (equal). Sums: 0, 0, -a, a; whitened over the 8 tokens, a cancels.
    a = 0.5 / (math.sqrt(0.5) + EPS)
    expected = T([0.0, 0.0, -a, a]).repeat_interleave(2)
    assert_close(advantages.flatten(), expected / torch.std(expected))
    # a part on a 100x scale counts no more: it is normalised within its groups first
    scaled = {"format": parts["format"] * 100, "accuracy": parts["accuracy"]}
    assert_close(run("gdpo", outcome([0] * 4), [[1, 1]] * 4, index, config, scores=scaled)[0], advantages)
    weighted = config.model_copy(update={"gdpo_reward_weights": (1.0, 2.0)})
    ours, _ = run("gdpo", outcome([0] * 4), [[1, 1]] * 4, index, weighted, scores=parts)
    assert ours[0, 0] < 0  # row 0: format +a, accuracy 2 x -a
    with pytest.raises(ValueError, match="gdpo_reward_keys"):
        run("gdpo", outcome([0] * 4), [[1, 1]] * 4, index, scores=parts)
    with pytest.raises(ValueError, match="not among"):
        run("gdpo", outcome([0] * 4), [[1, 1]] * 4, index, config, scores={"format": parts["format"]})


# ---------------------------------------------------------------- token-level estimators


def test_gae_skips_a_tool_response():
    # gamma = lam = 1; token 1 is a tool's output (mask 0): its reward 7 and value 9.9 are not seen.
    # t=2: delta = 1 - 0.5 = 0.5; t=0: delta = 0 + 0.5 - 0.2 = 0.3, advantage 0.3 + 0.5 = 0.8
    # returns = advantage + value = 1.0 on both loss tokens, 0 on the tool's
    values = T([[0.2, 9.9, 0.5], [0.0, 0.0, 0.0]])
    rewards, mask = [[0, 7.0, 1], [0, 0, 0]], [[1, 0, 1], [1, 1, 0]]
    advantages, returns = run("gae", rewards, mask, ["a", "b"], values=values)
    assert_close(returns, T([[1.0, 0, 1.0], [0.0, 0, 0]]))
    raw = T([0.8, 0.5, 0.0, 0.0])  # the loss tokens' advantages before whitening
    assert_close(advantages[T(mask).bool()], (raw - raw.mean()) / raw.std())
    assert advantages[0, 1] == 0 and advantages[1, 2] == 0


def test_reinforce_plus_plus_carries_the_return_across_a_tool_response():
    # gamma 0.5, token 1 a tool's: t=2 return 2; t=1 dropped (its 8 too); t=0: 1 + 0.5 x 2 = 2
    config = AlgorithmConfig(gamma=0.5)
    advantages, returns = run(
        "reinforce_plus_plus", [[1.0, 8, 2], [0, 0, 4]], [[1, 0, 1], [1, 1, 1]], ["a", "b"], config
    )
    assert_close(returns, T([[2.0, 0, 2], [1.0, 2, 4]]))
    loss = T([2.0, 2, 1, 2, 4])
    assert_close(advantages[T([[1, 0, 1], [1, 1, 1]]).bool()], (loss - loss.mean()) / loss.std())


def test_remax_baselines_with_the_greedy_responses_score():
    advantages, returns = run(
        "remax", [[0, 1.0, 2], [0, 0, 3]], [[1, 1, 0], [1, 1, 1]], ["a", "b"], reward_baselines=T([0.5, 1.0])
    )
    assert_close(returns, T([[1.0, 1, 0], [3, 3, 3]]))  # the reward on padding is not counted
    assert_close(advantages, T([[0.5, 0.5, 0], [2, 2, 2]]))


def _otb(name, rewards, mask, index, pi, **more):
    """``pi``: each token's probability; sum(pi^2) = pi^2 + (1 - pi)^2, two candidate tokens."""
    pi = T(pi)
    return run(name, rewards, mask, index, old_log_probs=pi.log(), sum_pi_squared=pi**2 + (1 - pi) ** 2, **more)


def test_optimal_token_baseline_weighs_rows_by_their_gradients_size():
    # pi = 0.5 everywhere: w = 1 - 1 + 0.5 = 0.5 per token on both rows, so the baseline is the
    # group's mean return, 0.5, at both steps
    rewards, mask = [[0, 1.0], [0, 0]], [[1, 1], [1, 1]]
    advantages, _ = _otb("optimal_token_baseline", rewards, mask, ["g", "g"], [[0.5, 0.5], [0.5, 0.5]])
    assert_close(advantages, T([[0.5, 0.5], [-0.5, -0.5]]))
    # row 1 sure of its tokens (pi = 1): w = 0, no weight; the baseline is row 0's own return
    advantages, _ = _otb("optimal_token_baseline", rewards, mask, ["g", "g"], [[0.5, 0.5], [1.0, 1.0]])
    assert_close(advantages, T([[0.0, 0.0], [-1.0, -1.0]]))
    # squared importance weights scale w: 3^2 on row 0 makes B = 9 x 1 / (9 + 1) = 0.9
    more = {"rollout_is_weights": T([[3.0, 3.0], [1.0, 1.0]])}
    advantages, _ = _otb("optimal_token_baseline", rewards, mask, ["g", "g"], [[0.5, 0.5], [0.5, 0.5]], **more)
    assert_close(advantages, T([[0.1, 0.1], [-0.9, -0.9]]))


def test_the_longest_responses_tail_has_no_baseline():
    # row 0 runs 3 tokens, row 1 only 2: at step 2 row 0 has nobody to compare with, B = 0
    rewards, mask = [[0, 0, 1.0], [0, 0, 0]], [[1, 1, 1], [1, 1, 0]]
    advantages, returns = _otb("optimal_token_baseline", rewards, mask, ["g", "g"], [[0.5] * 3] * 2)
    assert_close(returns, T([[1.0, 1, 1], [0, 0, 0]]))
    assert_close(advantages, T([[0.5, 0.5, 1.0], [-0.5, -0.5, 0.0]]))
    alone, _ = _otb("optimal_token_baseline", rewards[:1], mask[:1], ["g"], [[0.5] * 3])
    assert_close(alone, T([[1.0, 1, 1]]))  # a response alone: advantage = return


def test_tool_integrated_otb_lines_up_loss_tokens_not_positions():
    # row 0: loss tokens at 0 and 2 (a tool's output at 1); row 1 at 0 and 1; w = 0.5 a token.
    # TIR compares each one's 2nd loss token: B = (1 x 1 + 0 x 1) / 2 = 0.5 at both steps. The
    # positional OTB compares position 2 of row 0 with nothing (row 1 has ended; both have two
    # loss tokens, so there is no tail to zero), and its baseline there is row 0's own return
    rewards, mask, pi = [[0, 0, 1.0], [0, 0, 0]], [[1, 0, 1], [1, 1, 0]], [[0.5] * 3] * 2
    tir, _ = _otb("tir_optimal_token_baseline", rewards, mask, ["g", "g"], pi)
    assert_close(tir, T([[0.5, 0, 0.5], [-0.5, -0.5, 0]]))
    positional, _ = _otb("optimal_token_baseline", rewards, mask, ["g", "g"], pi)
    assert_close(positional, T([[0.5, 0, 0.0], [-0.5, 0.0, 0]]))
    # a response with no loss token is nobody's peer: row 0 is alone, its advantage its return
    empty, _ = _otb("tir_optimal_token_baseline", rewards, [[1, 0, 1], [0, 0, 0]], ["g", "g"], pi)
    assert_close(empty, T([[1.0, 0, 1], [0, 0, 0]]))
