"""Rewards: the registered functions, the task dispatch, and where a score lands."""

import numpy as np
import pytest
import torch
from skip_core.batch import Batch
from skip_core.config import ConfigError
from skip_plugin_trainer.algorithm_settings import OverlongBuffer, RewardConfig
from skip_plugin_trainer.reward import Rewarder, overlong_rewards, place_on_last_token, score_by_task


class Tokenizer:
    """Decodes ids to the text the test wants each row to read as."""

    def __init__(self, texts):
        self.texts = texts

    def batch_decode(self, ids, skip_special_tokens):
        return [self.texts[int(row[0])] for row in ids]


def test_scores_land_on_the_last_sampled_token():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])  # row 1 has a tool response in between
    placed = place_on_last_token(np.array([1.0, 2.0, 3.0]), mask)
    assert placed.tolist() == [[0, 1, 0, 0], [0, 0, 2, 0], [0, 0, 0, 3]]


def test_the_task_function_scores_by_data_source():
    assert score_by_task("arithmetic", "Answer: 42", "42") == 1.0
    assert score_by_task("arithmetic", "Answer: 41", "42") == 0.0
    with pytest.raises(ValueError, match="no installed task produces data_source 'gsm8k'"):
        score_by_task("gsm8k", "Answer: 42", "42")


def test_rewarder_adds_tool_rewards_unless_turned_off():
    texts = ["Answer: 7", "Answer: 8"]
    batch = Batch.from_dict(
        {"responses": torch.tensor([[0, 5], [1, 5]]), "response_mask": torch.tensor([[1, 1], [1, 0]])},
        {
            "data_source": ["arithmetic"] * 2,
            "ground_truth": ["7", "7"],
            "extra_info": [{}, {}],
            "reward_scores": [{"calculator": 0.5}, {}],
        },
    )
    scores, parts = Rewarder(RewardConfig(), Tokenizer(texts), 2)(batch)
    assert scores.tolist() == [[0.0, 1.5], [0.0, 0.0]]
    assert parts["score"].tolist() == [1.0, 0.0] and parts["tool_reward"].tolist() == [0.5, 0.0]
    scores, _ = Rewarder(RewardConfig(tool_rewards=False), Tokenizer(texts), 2)(batch)
    assert scores.tolist() == [[0.0, 1.0], [0.0, 0.0]]


def test_unknown_function_and_unscorable_data_fail_naming_the_key():
    with pytest.raises(ConfigError, match=r"reward.function: unknown reward function 'mine' \(installed: task\)"):
        Rewarder(RewardConfig(function="mine"), Tokenizer([]), 2)
    with pytest.raises(ConfigError, match=r"data\.train_files: rows have data_source 'gsm8k'"):
        Rewarder(RewardConfig(), Tokenizer([]), 2).check_sources({"arithmetic", "gsm8k"}, "data.train_files")


def test_the_overlong_buffer_punishes_linearly_past_the_expected_length():
    """max 20 tokens, buffer 8: free up to 12, then -factor x excess / 8, -factor at the cap."""
    buffer = OverlongBuffer(enable=True, len=8, penalty_factor=0.5)
    assert overlong_rewards(np.array([5, 12, 16, 20]), 20, buffer).tolist() == [0.0, 0.0, -0.25, -0.5]


def test_the_rewarder_adds_the_overlong_penalty_counting_every_response_token():
    texts = ["Answer: 7", "Answer: 7"]
    attention = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])  # 2 prompt + 2 / 4 response tokens
    batch = Batch.from_dict(
        {
            "responses": torch.tensor([[0, 5, 0, 0], [1, 5, 5, 5]]),
            "response_mask": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 1]]),  # row 1: a tool response inside
            "attention_mask": attention,
        },
        {"data_source": ["arithmetic"] * 2, "ground_truth": ["7", "7"], "extra_info": [{}, {}]},
    )
    config = RewardConfig(overlong_buffer=OverlongBuffer(enable=True, len=2, penalty_factor=1.0))
    scores, parts = Rewarder(config, Tokenizer(texts), 4)(batch)
    assert parts["overlong_reward"].tolist() == [0.0, -1.0]  # 4 of 4 tokens, tool ones included: the cap
    assert scores.sum(-1).tolist() == [1.0, 0.0]
