"""Rewards: the registered functions, the task dispatch, and where a score lands."""

import numpy as np
import pytest
import torch
from skip_core.batch import Batch
from skip_core.config import ConfigError
from skip_plugin_trainer.settings import RewardConfig
from skip_plugin_trainer.train.reward import Rewarder, place_on_last_token, score_by_task


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
    scores, parts = Rewarder(RewardConfig(), Tokenizer(texts))(batch)
    assert scores.tolist() == [[0.0, 1.5], [0.0, 0.0]]
    assert parts["score"].tolist() == [1.0, 0.0] and parts["tool_reward"].tolist() == [0.5, 0.0]
    scores, _ = Rewarder(RewardConfig(tool_rewards=False), Tokenizer(texts))(batch)
    assert scores.tolist() == [[0.0, 1.0], [0.0, 0.0]]


def test_unknown_function_and_unscorable_data_fail_naming_the_key():
    with pytest.raises(ConfigError, match=r"reward.function: unknown reward function 'mine' \(installed: task\)"):
        Rewarder(RewardConfig(function="mine"), Tokenizer([]))
    with pytest.raises(ConfigError, match=r"data\.train_files: rows have data_source 'gsm8k'"):
        Rewarder(RewardConfig(), Tokenizer([])).check_sources({"arithmetic", "gsm8k"}, "data.train_files")
