"""Rule-based rewards: a registered function scores each decoded response.

Reward functions register through ``skip_register_rewards`` with verl's ``compute_score``
signature, so a verl user's function plugs in unchanged; ``reward.function`` picks one, and
``reward.custom_reward_function.path`` loads one from a file, as verl does.
The sequence score lands on the last token the policy sampled, which is where the
advantage estimators that look at token positions (REINFORCE++) expect the outcome.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from skip_core.config import ConfigError, lookup

from skip_plugin_trainer.algorithm_settings import CustomRewardFunction, OverlongBuffer, RewardConfig

if TYPE_CHECKING:
    import torch
    from skip_core.batch import Batch

RewardFn = Callable[[str, str, Any, Mapping[str, Any]], float]


def score_by_task(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping | None = None) -> float:
    """The score of the registered task that produces ``data_source`` rows."""
    task = _tasks_by_source().get(data_source)
    if task is None:
        raise ValueError(f"no installed task produces data_source {data_source!r}")
    return task.score(solution_str, ground_truth)


@cache
def _tasks_by_source() -> dict[str, Any]:
    from skip_core.plugins import registry

    return {source: task for task in registry().tasks.values() for source in task.data_sources}


class Rewarder:
    """Scores rollouts with the configured function; checked against the data before step 1."""

    def __init__(self, config: RewardConfig, tokenizer: Any, max_response_length: int) -> None:
        from skip_core.plugins import registry

        custom = config.custom_reward_function
        if custom.path is not None:
            self.fn: RewardFn = load_reward_function(custom)
        else:
            self.fn = lookup("reward.function", "reward function", config.function, registry().rewards)
        self.config = config
        self.tokenizer = tokenizer
        self.max_response_length = max_response_length

    def check_sources(self, sources: set[str], key: str) -> None:
        """Fail before training when ``reward.function=task`` cannot score some rows."""
        if self.fn is not score_by_task:
            return
        unknown = sorted(s for s in sources if s not in _tasks_by_source())
        if unknown:
            have = ", ".join(sorted(_tasks_by_source())) or "none"
            raise ConfigError(
                f"{key}: rows have data_source {unknown[0]!r}, which no installed task scores "
                f"(reward.function=task knows: {have}); set reward.function to a registered function"
            )

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """Token-level scores [samples, response length] and per-sample parts for logging."""
        texts = self.tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
        extras = batch.non_tensor_batch
        scores = np.array(
            [
                _score(self.fn(extras["data_source"][i], text, extras["ground_truth"][i], extras["extra_info"][i]))
                for i, text in enumerate(texts)
            ]
        )
        tools = np.zeros(len(batch))
        if self.config.tool_rewards and "reward_scores" in extras:
            tools = np.array([sum(float(v) for v in (r or {}).values()) for r in extras["reward_scores"]])
        parts = {"score": scores, "tool_reward": tools}
        total = scores + tools
        if self.config.overlong_buffer.enable:
            width = batch.batch["responses"].shape[1]
            lengths = batch.batch["attention_mask"][:, -width:].sum(-1).numpy()  # tool responses count, as in verl
            parts["overlong_reward"] = overlong_rewards(lengths, self.max_response_length, self.config.overlong_buffer)
            total = total + parts["overlong_reward"]
        return place_on_last_token(total, batch.batch["response_mask"]), parts


def _score(result: Any) -> float:
    """A score, or verl's dict holding one under ``score`` (its other entries are the function's)."""
    return float(result["score"] if isinstance(result, Mapping) else result)


def load_reward_function(custom: CustomRewardFunction) -> RewardFn:
    """``custom.name`` from the Python file ``custom.path``: a module of its own, imported once."""
    path = Path(custom.path).expanduser().absolute()
    key = "reward.custom_reward_function"
    if path.suffix != ".py" or not path.is_file():
        raise ConfigError(f"{key}.path: expected a Python file (.py), got {custom.path!r}")
    module_name = f"skip_custom_reward_{abs(hash(str(path)))}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # the user's code: its failure named in one line
            raise ConfigError(f"{key}.path: importing {path} failed: {exc!r}") from None
        sys.modules[module_name] = module
    fn = getattr(module, custom.name, None)
    if not callable(fn):
        raise ConfigError(f"{key}.name: {path} has no function {custom.name!r}")
    return fn


def overlong_rewards(lengths: np.ndarray, max_length: int, buffer: OverlongBuffer) -> np.ndarray:
    """DAPO's soft overlong punishment: 0 up to ``max_length - buffer.len`` tokens, then falling
    linearly to ``-buffer.penalty_factor`` at ``max_length``."""
    excess = lengths - (max_length - buffer.len)
    return np.minimum(-excess / buffer.len * buffer.penalty_factor, 0.0)


def place_on_last_token(scores: np.ndarray, response_mask: torch.Tensor) -> torch.Tensor:
    """A [samples, length] tensor holding each score on its last sampled token (last token if none)."""
    import torch  # here, not at the top: this module loads with `skip`, whose startup must not pay for torch

    length = response_mask.shape[1]
    positions = torch.arange(length).expand_as(response_mask)
    last = torch.where(response_mask.bool(), positions, -1).max(dim=1).values
    last = torch.where(last < 0, length - 1, last)
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    out[torch.arange(len(scores)), last] = torch.as_tensor(scores, dtype=torch.float32)
    return out
