"""Role ``reward``'s own rule: a score belongs to its response. What every role satisfies is
tests/test_role_contract.py."""

import pytest
import torch
from skip_core import Batch, ConfigError, SkipManager
from skiptests import run_config


class Scorer:
    """A reward function: the score of a row is the sum of its tokens (prompt and response)."""

    def __init__(self) -> None:
        self.runs = 0

    @SkipManager.annotate(role="reward")
    def compute(self, prompts: Batch) -> Batch:
        self.runs += 1
        scores = prompts.batch["input_ids"].sum(-1, keepdim=True).float()
        return Batch.from_dict({"scores": scores}, {"uid": prompts.non_tensor_batch["uid"]})


def responses() -> Batch:
    return Batch.from_dict({"input_ids": torch.arange(6).reshape(2, 3)}, {"uid": ["a", "b"]})


def test_other_responses_at_a_cached_step_are_scored_again_and_replace_the_entry(tmp_path):
    SkipManager.init(run_config(tmp_path, role="reward", steps=[1]))  # its default on_prompt_mismatch
    scorer = Scorer()
    SkipManager.set_step(1)
    scorer.compute(responses())
    SkipManager.flush()
    other = responses()
    other.batch["input_ids"][0, -1] += 1  # another response to the same prompt

    rescored = scorer.compute(other)
    SkipManager.flush()

    assert scorer.runs == 2 and torch.equal(rescored.batch["scores"][:, 0], other.batch["input_ids"].sum(-1).float())
    assert scorer.compute(other).equals(rescored) and scorer.runs == 2


def test_loading_the_score_of_other_responses_with_a_warning_is_refused(tmp_path):
    with pytest.raises(ConfigError) as raised:
        SkipManager.init(run_config(tmp_path, role="reward", on_prompt_mismatch="warn"))
    assert str(raised.value) == "skip.reward.on_prompt_mismatch: expected 'regenerate' or 'error', got 'warn'"
