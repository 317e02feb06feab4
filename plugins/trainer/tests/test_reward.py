"""Rewards: the registered functions, the task dispatch, and where a score lands."""

import json
import math
import re
import textwrap
import threading

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from pydantic import ValidationError
from skip_core.batch import Batch
from skip_core.cli import cli
from skip_core.config import ConfigError
from skip_core.errors import SkipError
from skip_plugin_trainer.config.algorithm import CustomRewardFunction, OverlongBuffer, RewardConfig
from skip_plugin_trainer.reward import (
    MAX_HUNG_CALLS,
    Rewarder,
    RewardFunctionError,
    RewardWarning,
    load_reward_function,
    overlong_rewards,
    place_on_last_token,
    score_by_task,
)
from skiptests import CONFIGS
from training import metrics, overrides


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


def test_verls_gdpo_manager_tells_the_function_the_experiment_and_naive_does_not(tmp_path):
    """As verl's GDPO manager does: GDPO's own reward (rlla.py) reads extra_info["experiment_name"]."""
    source = tmp_path / "told.py"
    source.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float(extra_info.get('experiment_name') == 'exp-7') + extra_info['index']\n"
    )
    batch = Batch.from_dict(
        {"responses": torch.tensor([[0, 5]]), "response_mask": torch.tensor([[1, 1]])},
        {"data_source": ["any"], "ground_truth": ["7"], "extra_info": [{"index": 10}]},
    )
    custom = {"path": str(source)}
    for manager, expected in (("gdpo", 11.0), ("naive", 10.0), ("dapo", 10.0)):
        config = RewardConfig(manager=manager, custom_reward_function=custom)
        scores, _ = Rewarder(config, Tokenizer(["Answer: 7"]), 2, experiment_name="exp-7")(batch)
        assert scores.sum() == expected, manager
    assert batch.non_tensor_batch["extra_info"][0] == {"index": 10}  # the row's own dict is left as it was


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


# -- the user's reward function: never a hang, never a silent NaN, never a traceback -----------------

PRELUDE = """\
import itertools, math, threading

import numpy as np

release = threading.Event()  # set at the test's end: a call waiting on it returns
calls = itertools.count()
"""


@pytest.fixture
def custom(tmp_path):
    """``custom(body, **reward)``: a ``RewardConfig`` whose ``compute_score`` is ``body``, in a file
    under ``tmp_path`` after ``PRELUDE``. At the end every call still waiting on ``release`` returns,
    and the threads of the calls given up on are joined: none outlives its test."""
    made = []

    def write(body: str, **reward) -> RewardConfig:
        path = tmp_path / f"reward_{len(made)}.py"
        path.write_text(PRELUDE + textwrap.dedent(body))
        made.append(CustomRewardFunction(path=str(path)))
        return RewardConfig(custom_reward_function=made[-1], **reward)

    yield write
    for function in made:
        load_reward_function(function).__globals__["release"].set()
    for thread in threading.enumerate():
        if thread.name == "skip-reward":
            thread.join(timeout=60)
    assert not [t for t in threading.enumerate() if t.name == "skip-reward"]


def responses(texts, truths=None) -> Batch:
    """A batch whose row i decodes to ``texts[i]`` (``Tokenizer``), of data_source ``src`` and row index 10 + i."""
    n = len(texts)
    return Batch.from_dict(
        {"responses": torch.arange(n)[:, None].repeat(1, 2), "response_mask": torch.ones(n, 2, dtype=torch.long)},
        {
            "data_source": ["src"] * n,
            "ground_truth": truths if truths is not None else [""] * n,
            "extra_info": [{"index": 10 + i} for i in range(n)],
        },
    )


def label(config: RewardConfig) -> str:
    return f"compute_score in {config.custom_reward_function.path} (reward.custom_reward_function)"


def test_a_call_past_the_timeout_scores_0_is_counted_and_named_and_the_next_call_runs(custom):
    config = custom(
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "slow":
                release.wait()
            return 1.0
        """,
        timeout_s=0.5,  # far above a call that returns at once, also on a loaded machine
    )
    texts = ["fast", "slow", "fast", "slow"]
    rewarder = Rewarder(config, Tokenizer(texts), 2)
    with pytest.warns(RewardWarning) as said:
        scores, parts = rewarder(responses(texts))

    assert parts["score"].tolist() == [1.0, 0.0, 1.0, 0.0]  # a fresh thread scores the sample after a hung one
    assert parts["reward_timed_out"].tolist() == [False, True, False, True]
    assert not parts["reward_non_finite"].any()
    assert scores.sum(-1).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert [str(w.message) for w in said] == [
        f"reward.timeout_s: reward function {label(config)} ran past 0.5 s on sample {i} "
        f"(data_source 'src', extra_info.index {10 + i}); it scores 0 (counted in reward/timeouts)"
        for i in (1, 3)
    ]
    assert rewarder.calls.hung == 2
    rewarder.fn.__globals__["release"].set()  # the calls given up on return: their threads end
    for thread in [t for t in threading.enumerate() if t.name == "skip-reward"]:
        thread.join(timeout=60)
    assert rewarder.calls.hung == 0


def test_calls_that_never_return_stop_the_run_in_one_line_past_the_bound(custom):
    config = custom(
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            next(calls)
            release.wait()
        """,
        timeout_s=0.05,
    )
    texts = ["x"] * (MAX_HUNG_CALLS + 2)
    rewarder = Rewarder(config, Tokenizer(texts), 2)
    message = (
        f"reward.timeout_s: {MAX_HUNG_CALLS} calls of reward function {label(config)} that ran past 0.05 s are "
        "still running; stopping rather than starting more threads beside them: fix the function, or raise "
        "reward.timeout_s"
    )
    with pytest.warns(RewardWarning) as said, pytest.raises(RewardFunctionError) as raised:
        rewarder(responses(texts))
    assert str(raised.value) == message
    assert len(said) == MAX_HUNG_CALLS  # one warning per call given up on, then the error instead of a call
    rewarder.fn.__globals__["release"].set()
    for thread in [t for t in threading.enumerate() if t.name == "skip-reward"]:
        thread.join(timeout=60)
    assert next(rewarder.fn.__globals__["calls"]) == MAX_HUNG_CALLS  # the call refused never ran
    assert rewarder.calls.hung == 0


def test_nan_and_infinite_scores_are_counted_named_and_replaced_by_0(custom):
    config = custom(
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(ground_truth) if ground_truth != "huge" else 10**400
        """
    )
    truths = ["0.5", "nan", "inf", "-inf", "huge", "0.25"]
    with pytest.warns(RewardWarning) as said:
        scores, parts = Rewarder(config, Tokenizer([""] * 6), 2)(responses([""] * 6, truths))

    assert parts["score"].tolist() == [0.5, 0.0, 0.0, 0.0, 0.0, 0.25]
    assert parts["reward_non_finite"].tolist() == [False, True, True, True, True, False]
    assert torch.isfinite(scores).all() and scores.sum(-1).tolist() == [0.5, 0.0, 0.0, 0.0, 0.0, 0.25]
    assert [str(w.message) for w in said] == [
        f"reward function {label(config)} returned -inf, inf, nan for 4 of 6 samples (the first: sample 1 "
        "(data_source 'src', extra_info.index 11)); they score 0 (counted in reward/non_finite)"
    ]


def test_numbers_of_every_kind_and_verls_dict_are_scores(custom):
    """A bool is 0 or 1 (verl's exact-match scorers return one); numpy's scalars are numbers."""
    config = custom(
        """
        VALUES = {
            "true": True, "int": 2, "np.float32": np.float32(0.25), "np.int64": np.int64(3),
            "np.bool_": np.bool_(False), "dict": {"score": True, "acc": 1.0}, "np dict": {"score": np.float64(-1.5)},
        }

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return VALUES[ground_truth]
        """
    )
    truths = ["true", "int", "np.float32", "np.int64", "np.bool_", "dict", "np dict"]
    _, parts = Rewarder(config, Tokenizer([""] * 7), 2)(responses([""] * 7, truths))
    assert parts["score"].tolist() == [1.0, 2.0, 0.25, 3.0, 0.0, 1.0, -1.5]


def test_a_dicts_other_numbers_are_named_parts_beside_the_score(custom):
    """verl's reward_extra_info (what GDPO normalises): each finite number of the returned dict,
    by its key, 0 for a sample without it; text, non-finite numbers and the batch's own keys stay out."""
    config = custom(
        """
        VALUES = {
            "a": {"score": 1.0, "format": 0.5, "note": "ok", "data_source": 7.0},
            "b": {"score": 0.0, "format": True, "length": 3},
            "c": 0.25,
            "d": {"score": 0.5, "format": float("nan")},
        }

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return VALUES[ground_truth]
        """
    )
    _, parts = Rewarder(config, Tokenizer([""] * 4), 2)(responses([""] * 4, ["a", "b", "c", "d"]))
    assert parts["score"].tolist() == [1.0, 0.0, 0.25, 0.5]
    assert parts["format"].tolist() == [0.5, 1.0, 0.0, 0.0] and parts["length"].tolist() == [0.0, 3.0, 0.0, 0.0]
    assert "note" not in parts and "data_source" not in parts


@pytest.mark.parametrize(
    ("returns", "what"),
    [
        ("'one'", "returned str 'one'"),
        ("[1.0]", "returned list [1.0]"),
        ("None", "returned None"),
        ("{'acc': 1.0}", "returned dict {'acc': 1.0}"),
        ("{'score': 'high'}", "returned dict {'score': 'high'}"),
        ("1 + 2j", "returned complex (1+2j)"),
        ("'\\x1b[2J\\u202e'", "returned str '\\x1b[2J\\u202e'"),
        ("print", "returned builtin_function_or_method <built-in function print>"),
        ("list(range(10**6))", "returned list [0, 1, 2, 3, 4, 5, ...]"),
    ],
)
def test_a_return_that_is_no_score_stops_in_one_line_naming_the_function_sample_and_value(custom, returns, what):
    config = custom(
        f"""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0 if solution_str == "good" else {returns}
        """
    )
    texts = ["good", "bad"]
    with pytest.raises(RewardFunctionError) as raised:
        Rewarder(config, Tokenizer(texts), 2)(responses(texts))
    assert str(raised.value) == (
        f"reward function {label(config)} {what} on sample 1 (data_source 'src', extra_info.index 11); "
        "expected a number (a bool counts as 0 or 1) or a dict holding one under 'score'"
    )
    assert "\x1b" not in str(raised.value) and "\n" not in str(raised.value)


def test_an_exception_stops_in_one_line_naming_its_type_and_message_escaped(custom):
    config = custom(
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            raise ValueError("no answer in\\n" + solution_str + "\\x1b[31m")
        """
    )
    with pytest.raises(RewardFunctionError) as raised:
        Rewarder(config, Tokenizer(["Answer:  7"]), 2)(responses(["Answer:  7"]))
    assert str(raised.value) == (
        f"reward function {label(config)} raised ValueError: no answer in Answer: 7\\x1b[31m on sample 0 "
        "(data_source 'src', extra_info.index 10)"
    )
    assert isinstance(raised.value, SkipError) and isinstance(raised.value.__cause__, ValueError)


def test_a_registered_function_is_named_by_reward_function():
    """The task's scorer reads a string ground truth: what ``check_data`` refuses before step 1."""
    batch = Batch.from_dict(
        {"responses": torch.tensor([[0, 5]]), "response_mask": torch.tensor([[1, 1]])},
        {"data_source": ["arithmetic"], "ground_truth": [None], "extra_info": [{}]},
    )
    with pytest.raises(RewardFunctionError) as raised:
        Rewarder(RewardConfig(), Tokenizer(["Answer: 7"]), 2)(batch)
    assert str(raised.value) == (
        "reward function task (reward.function) raised AttributeError: 'NoneType' object has no attribute "
        "'strip' on sample 0 (data_source 'arithmetic')"
    )


def test_the_timeout_must_be_a_positive_number():
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValidationError, match="timeout_s"):
            RewardConfig(timeout_s=bad)
    assert RewardConfig().timeout_s == 60.0


@pytest.mark.parametrize(
    ("truth", "function", "refused"),
    [
        (None, "task", "None"),
        ({"target": "7"}, "task", "dict {'target': '7'}"),
        ({"target": "7"}, "custom", None),  # a dict is the user's function's to take: nothing is guessed
    ],
    ids=["none-task", "dict-task", "dict-custom"],
)
def test_check_refuses_a_ground_truth_the_task_cannot_take_naming_file_row_and_column(
    task_dir, tmp_path, custom, truth, function, refused
):
    import pyarrow.parquet as pq

    rows = pq.read_table(task_dir / "data" / "train.parquet").to_pylist()[:4]
    rows[2]["reward_model"]["ground_truth"] = truth
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    more = [f"data.train_files=[{data}]", "data.train_batch_size=2", "actor.ppo_mini_batch_size=1"]
    if function == "custom":
        path = custom("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
        more.append(f"reward.custom_reward_function.path={path.custom_reward_function.path}")

    result = CliRunner().invoke(
        cli, ["run", "--config-dir", str(CONFIGS), "--check", *overrides(task_dir, tmp_path, *more)]
    )
    if refused is None:
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 1 and result.output.splitlines() == [
        f"Error: {data}, line 3: reward_model.ground_truth is {refused}; the arithmetic task, which "
        "reward.function=task scores data_source 'arithmetic' with, takes a str there (data.train_files)"
    ]


def test_a_run_scores_hung_and_nan_calls_0_counts_them_and_stops_in_one_line_on_a_raise(
    ray_session, task_dir, tmp_path, custom
):
    """Step 1's 8 samples (4 prompts x 2): calls 0 and 4 hang, 1 and 5 return NaN; step 2's first call raises."""
    config = custom(
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            k = next(calls)
            if k >= 8:
                return 1 / 0
            if k % 4 == 0:
                release.wait()
            return math.nan if k % 4 == 1 else 0.5
        """
    )
    run = (
        f"reward.custom_reward_function.path={config.custom_reward_function.path}",
        "reward.timeout_s=0.5",
        "trainer.total_training_steps=2",
        "trainer.test_freq=0",
    )
    with pytest.warns(RewardWarning) as said:
        result = CliRunner().invoke(cli, ["run", "--config-dir", str(CONFIGS), *overrides(task_dir, tmp_path, *run)])

    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert re.fullmatch(
        re.escape(f"Error: reward function {label(config)} raised ZeroDivisionError: division by zero on sample 0 ")
        + r"\(data_source 'arithmetic', extra_info\.index \d+\)",
        result.output.splitlines()[-1],
    ), result.output
    said = [str(w.message) for w in said]
    assert [m.split(" ran past ")[0] for m in said if "reward/timeouts" in m] == [
        f"reward.timeout_s: reward function {label(config)}"
    ] * 2
    assert [m.split(" for ")[1].split(" (")[0] for m in said if "reward/non_finite" in m] == ["2 of 8 samples"]
    (step,) = [row for row in metrics(tmp_path / "run") if row["step"] == 1]
    assert (step["reward/timeouts"], step["reward/non_finite"]) == (2.0, 2.0)
    assert all(math.isfinite(value) for value in step.values() if isinstance(value, float)), step
