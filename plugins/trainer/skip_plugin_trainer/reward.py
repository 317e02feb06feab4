"""Rule-based rewards: a registered function scores each decoded response.

Reward functions register through ``skip_register_rewards`` with verl's ``compute_score``
signature, so a verl user's function plugs in unchanged; ``reward.function`` picks one, and
``reward.custom_reward_function.path`` loads one from a file, as verl does.
The sequence score lands on the last token the policy sampled, which is where the
advantage estimators that look at token positions (REINFORCE++) expect the outcome.

The function is the user's code, and none of its failures may hang the run, poison it or end it
in a traceback. Each call runs on a thread the trainer stops waiting for after
``reward.timeout_s`` (``timed_calls``): that sample scores 0, as in verl's PRIME reward manager.
A NaN or infinite score is replaced by 0 too, so that advantages stay finite. Both are counted
per sample (``reward/timeouts``, ``reward/non_finite`` per step) and said in a warning. A call
that raises, or returns anything but a number (a bool counts as 0 or 1) or a dict holding one
under ``score``, stops the run with a ``RewardFunctionError``: one line naming the function,
the sample and what it raised or returned.
"""

from __future__ import annotations

import math
import numbers
import reprlib
import warnings
from collections.abc import Callable, Mapping
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np
from skip_core.config import ConfigError, lookup
from skip_core.errors import SkipError
from skip_core.escaping import printable

from skip_plugin_trainer import user_code
from skip_plugin_trainer.config.algorithm import CustomRewardFunction, OverlongBuffer, RewardConfig
from skip_plugin_trainer.timed_calls import TimedCalls, TooManyHung

if TYPE_CHECKING:
    import torch
    from skip_core.batch import Batch

    from skip_plugin_trainer.data.dataset import RLDataset

RewardFn = Callable[[str, str, Any, Mapping[str, Any]], float]

#: Calls past ``reward.timeout_s`` that may still be running when the next one starts: one more
#: stops the run rather than start yet another thread beside them (each may hold memory, or a
#: CPU, for as long as it runs).
MAX_HUNG_CALLS = 8
#: What a score may be, for the message of a call that returned something else.
EXPECTED = "expected a number (a bool counts as 0 or 1) or a dict holding one under 'score'"
#: How a message shows what a function returned: a list's first elements, a string's start.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80


class RewardFunctionError(SkipError, ValueError):
    """A reward function raised, returned no score, or hangs on too many calls; the message names
    it, the sample and what it raised or returned."""


class RewardWarning(UserWarning):
    """A sample scored 0 instead of what its reward function gave: the call ran past
    ``reward.timeout_s``, or the score was NaN or infinite."""


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

    def __init__(
        self, config: RewardConfig, tokenizer: Any, max_response_length: int, experiment_name: str | None = None
    ) -> None:
        from skip_core.plugins import registry

        custom = config.custom_reward_function
        if custom.path is not None:
            self.fn: RewardFn = load_reward_function(custom)
            self.label = f"{custom.name} in {user_code.source(custom.path)} (reward.custom_reward_function)"
        else:
            self.fn = lookup("reward.function", "reward function", config.function, registry().rewards)
            self.label = f"{config.function} (reward.function)"
        self.config = config
        # verl's GDPO manager tells the function the experiment (its GDPO rewards read it)
        self.told = {"experiment_name": experiment_name} if config.manager == "gdpo" else {}
        self.tokenizer = tokenizer
        self.max_response_length = max_response_length
        self.calls = TimedCalls(config.timeout_s, MAX_HUNG_CALLS, name="skip-reward")

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

    def check_data(self, dataset: RLDataset, key: str) -> None:
        """Fail before step 1 (and in ``--check``) where ``reward.function=task`` cannot score a row
        of ``dataset``, read from ``key``'s files: no task for its data_source, or a ground truth
        its task does not take (``Task.ground_truth_types``). Any other function's inputs are its
        own: nothing is guessed about them (verl's own scorers take a dict for some sources)."""
        if self.fn is not score_by_task:
            return
        rows = list(dataset.reward_inputs())
        self.check_sources({source for _, source, _ in rows}, key)
        for where, source, truth in rows:
            task = _tasks_by_source()[source]
            if not isinstance(truth, task.ground_truth_types):
                takes = " or ".join(kind.__name__ for kind in task.ground_truth_types)
                raise ConfigError(
                    f"{printable(where)}: reward_model.ground_truth is {_shown(truth)}; the {task.name} task, which "
                    f"reward.function=task scores data_source {source!r} with, takes a {takes} there ({key})"
                )

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """Token-level scores [samples, response length] and per-sample parts for logging."""
        texts = self.tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
        extras = batch.non_tensor_batch
        scores, timed_out, named = self._scores(texts, extras)
        non_finite = ~np.isfinite(scores)
        if non_finite.any():
            first = int(np.flatnonzero(non_finite)[0])
            values = ", ".join(sorted({repr(float(v)) for v in scores[non_finite]}))
            warnings.warn(
                f"reward function {self.label} returned {values} for {int(non_finite.sum())} of {len(scores)} "
                f"samples (the first: {_sample(first, extras)}); they score 0 (counted in reward/non_finite)",
                RewardWarning,
                stacklevel=2,
            )
            scores[non_finite] = 0.0
        tools = np.zeros(len(batch))
        if self.config.tool_rewards and "reward_scores" in extras:
            tools = np.array([sum(float(v) for v in (r or {}).values()) for r in extras["reward_scores"]])
        parts = {"score": scores, "tool_reward": tools, "reward_timed_out": timed_out, "reward_non_finite": non_finite}
        # a part never replaces what the batch holds already (its data_source, uid ...)
        parts |= {key: values for key, values in named.items() if key not in parts and key not in extras}
        total = scores + tools
        if self.config.overlong_buffer.enable:
            width = batch.batch["responses"].shape[1]
            lengths = batch.batch["attention_mask"][:, -width:].sum(-1).numpy()  # tool responses count, as in verl
            parts["overlong_reward"] = overlong_rewards(lengths, self.max_response_length, self.config.overlong_buffer)
            total = total + parts["overlong_reward"]
        return place_on_last_token(total, batch.batch["response_mask"]), parts

    def _scores(
        self, texts: list[str], extras: Mapping[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """Each sample's score as the function gave it (NaN and infinities included), 0 for a call
        past ``reward.timeout_s``; which calls were; and the other numbers of the dicts the function
        returned (verl's ``reward_extra_info``: GDPO's parts), by key, 0 where a sample had none."""
        scores, timed_out = np.zeros(len(texts)), np.zeros(len(texts), dtype=bool)
        named: dict[str, np.ndarray] = {}
        try:
            for i, text in enumerate(texts):
                outcome = self._call(i, text, extras)
                if outcome is None:
                    timed_out[i] = True
                    continue
                scores[i] = outcome[0]
                for key, value in outcome[1].items():
                    named.setdefault(key, np.zeros(len(texts)))[i] = value
        finally:
            self.calls.close()
        return scores, timed_out, named

    def _call(self, i: int, text: str, extras: Mapping[str, np.ndarray]) -> tuple[float, dict[str, float]] | None:
        """Sample ``i``'s score as the function gave it, with the dict's other numbers; None for a
        call past ``reward.timeout_s``."""
        extra_info = extras["extra_info"][i]
        if self.told:
            extra_info = {**(extra_info or {}), **self.told}
        args = (extras["data_source"][i], text, extras["ground_truth"][i], extra_info)
        timeout = f"{self.config.timeout_s:g} s"
        try:
            outcome = self.calls.call(self.fn, *args)
        except TooManyHung as exc:
            raise RewardFunctionError(
                f"reward.timeout_s: {exc.running} calls of reward function {self.label} that ran past {timeout} "
                "are still running; stopping rather than starting more threads beside them: fix the function, "
                "or raise reward.timeout_s"
            ) from None
        if outcome.timed_out:
            warnings.warn(
                f"reward.timeout_s: reward function {self.label} ran past {timeout} on {_sample(i, extras)}; "
                "it scores 0 (counted in reward/timeouts)",
                RewardWarning,
                stacklevel=4,
            )
            return None
        if outcome.error is not None:
            raise RewardFunctionError(
                f"reward function {self.label} raised {user_code.described(outcome.error)} on {_sample(i, extras)}"
            ) from outcome.error
        score = _score(outcome.value)
        if score is None:
            raise RewardFunctionError(
                f"reward function {self.label} returned {_shown(outcome.value)} on {_sample(i, extras)}; {EXPECTED}"
            )
        return score, _named_numbers(outcome.value)


def _named_numbers(result: Any) -> dict[str, float]:
    """The finite numbers of a returned dict beside its ``score``, by key (its other entries are
    the function's own: text, lists ... stay out)."""
    if not isinstance(result, Mapping):
        return {}
    return {
        str(key): float(value)
        for key, value in result.items()
        if key != "score" and isinstance(value, (numbers.Real, np.bool_)) and math.isfinite(float(value))
    }


def _score(result: Any) -> float | None:
    """A score: a number (numpy's too; a bool counts as 0 or 1, as verl's exact-match scorers
    return one), or verl's dict holding one under ``score`` (its other entries are the
    function's). None for anything else."""
    value = result.get("score") if isinstance(result, Mapping) else result
    if not isinstance(value, (numbers.Real, np.bool_)):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer past a float's range: an infinity, replaced as one
        return math.inf if value > 0 else -math.inf


def _sample(i: int, extras: Mapping[str, np.ndarray]) -> str:
    """Sample ``i`` of the batch as a message names it: its data_source, and its row's index when known."""
    extra_info = extras["extra_info"][i]
    index = extra_info.get("index") if isinstance(extra_info, Mapping) else None
    row = "" if index is None else f", extra_info.index {printable(_SHORT.repr(index))}"
    return f"sample {i} (data_source {printable(_SHORT.repr(extras['data_source'][i]))}{row})"


def _shown(value: Any) -> str:
    """A value a message quotes: its type and a short repr, control characters escaped."""
    return "None" if value is None else f"{type(value).__name__} {printable(_SHORT.repr(value))}"


def load_reward_function(custom: CustomRewardFunction) -> RewardFn:
    """``custom.name`` from the Python file ``custom.path``."""
    fn = user_code.load_object(custom.path, custom.name, "reward.custom_reward_function")
    if not callable(fn):
        raise ConfigError(f"reward.custom_reward_function.name: {custom.name!r} in {custom.path} is not a function")
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
