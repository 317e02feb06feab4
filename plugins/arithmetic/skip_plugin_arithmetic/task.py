"""The embedded default task ``arithmetic``: multi-digit integer arithmetic with a calculator.

Everything is generated locally, so a run works offline from the first command: the train and
validation parquet files (verl's row shape, tools named per row) and a tiny model warmed up
to use the ``calculator`` tool (see ``skip_plugin_arithmetic.tiny_model``). The prompt asks for
the result as ``Answer: <integer>``, which is all the exact-match score reads:

    user:      What is 482 * 37? Write the result as Answer: <integer>.
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "482 * 37"}}</tool_call>
    tool:      17834
    assistant: Answer: 17834

What RL has to learn is visible behaviour, not a skill a two-layer model cannot pick up from
a few hundred rewards: the warm-up demonstrations end that way only ``GRADED_SHARE`` of the
time, and otherwise restate the equation (``482 * 37 = 17834``) against the prompt's request,
so the warmed-up model usually computes the right number and then writes it in a form that
scores 0. Samples that follow the instruction win their group, and the validation score rises
from that share towards the model's accuracy with the calculator within a few steps. Copying
digits exactly stays hard for the model; its mistakes there are the score's ceiling.

Options (the ``task`` config section; a missing key takes its default):

- ``seed`` (integer, default 0): the problems, the tokenizer corpus and the model's weights.
- ``train_size`` (integer >= 1, default 2000), ``val_size`` (integer >= 1, default 64): rows.
- ``warmup_steps`` (integer >= 0, default 350): supervised steps before RL; 0 leaves the model random.

Assets are built only when missing: after changing an option, delete the task directory
(or the piece concerned) to rebuild.
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, NonNegativeInt, PositiveInt
from skip_core.files import replacing
from skip_plugin_trainer.settings import TaskConfig
from skip_plugin_trainer.tasks import Task, TaskAssets

DATA_SOURCE = "arithmetic"

_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_ANSWER = re.compile(r"Answer:\s*(-?\d+)(?![.,]?\d)")
# Warm-up demonstrations come from their own stream so the model never sees the RL prompts.
_WARMUP_SPLIT = "warmup"
_WARMUP_PROBLEMS = 4000
GRADED_SHARE = 0.35
"""How many warm-up demonstrations answer as the prompt asks; the others restate the equation."""
INSTRUCTION = "Write the result as Answer: <integer>."


def problem(rng: random.Random) -> tuple[str, str]:
    """One expression, ``a op b`` or ``(a op b) op c`` with 2 or 3 digit operands, and its value.

    Operands stay below 1000 because copying long numbers is what a one-minute warm-up of a
    tiny model cannot teach; products still reach 9 digits, which only the calculator gets right.
    """
    a, b = _operand(rng), _operand(rng)
    op = rng.choice(tuple(_OPERATORS))
    expression, value = f"{a} {op} {b}", _OPERATORS[op](a, b)
    if rng.random() < 0.5:
        c, op = _operand(rng), rng.choice(tuple(_OPERATORS))
        expression, value = f"({expression}) {op} {c}", _OPERATORS[op](value, c)
    return expression, str(value)


def _operand(rng: random.Random) -> int:
    digits = rng.randint(2, 3)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def problems(split: str, size: int, seed: int) -> list[tuple[str, str]]:
    # A string seed is hashed the same way in every process, unlike hash(tuple).
    rng = random.Random(f"{DATA_SOURCE}-{split}-{seed}")
    return [problem(rng) for _ in range(size)]


def prompt(expression: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {expression}? {INSTRUCTION}"}]


def expression_of(question: str) -> str:
    """The expression a prompt's question asks about (the inverse of ``prompt``)."""
    return question.removeprefix("What is ").removesuffix(f"? {INSTRUCTION}")


def rows(split: str, size: int, seed: int) -> list[dict[str, Any]]:
    """Dataset rows shaped like verl's, the calculator enabled per row.

    The ground truth is also passed to the tool's ``create`` so a tool-side reward can use
    it; a non-empty struct also keeps parquet from dropping the ``tools_kwargs`` column.
    """
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": prompt(expression),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {
                "split": split,
                "index": index,
                "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": answer}}},
            },
        }
        for index, (expression, answer) in enumerate(problems(split, size, seed))
    ]


def demonstration(expression: str, answer: str, graded: bool = True) -> list[dict[str, Any]]:
    """A conversation of the calculator protocol for one problem: call the tool, copy its result.

    ``graded`` ends it as the prompt asks, ``Answer: <result>``, the conversation a rollout
    should produce; otherwise it restates the equation, ``<expression> = <result>``, which
    holds the right number and scores 0.
    """
    conversation = prompt(expression)
    for step, result in calls(expression, answer):
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": step}}}
        conversation.append({"role": "assistant", "content": "", "tool_calls": [call]})
        conversation.append({"role": "tool", "name": "calculator", "content": result})
    final = f"Answer: {answer}" if graded else f"{expression} = {answer}"
    return [*conversation, {"role": "assistant", "content": final}]


def calls(expression: str, answer: str) -> list[tuple[str, str]]:
    """The calculator calls a demonstration makes, one operation each, and their results:
    ``(a op b) op c`` takes two, the second starting from the first's result."""
    if not expression.startswith("("):
        return [(expression, answer)]
    inner, rest = expression[1:].split(")", 1)
    first = str(_apply(inner))
    return [(inner, first), (f"{first}{rest}", answer)]


def _apply(expression: str) -> int:
    """The value of ``a op b``, read by splitting, never evaluated as code."""
    a, op, b = expression.split()
    return _OPERATORS[op](int(a), int(b))


def demonstrations(size: int, seed: int) -> list[list[dict[str, Any]]]:
    """The warm-up's conversations: problems of their own split, ``GRADED_SHARE`` of them graded."""
    rng = random.Random(f"{DATA_SOURCE}-{_WARMUP_SPLIT}-format-{seed}")
    return [demonstration(*pair, graded=rng.random() < GRADED_SHARE) for pair in problems(_WARMUP_SPLIT, size, seed)]


def score(response: str, ground_truth: str) -> float:
    """1.0 when the last ``Answer: <integer>`` in the response is exactly the ground truth.

    Only the final answer counts, wherever it sits among other text; an answer with a
    fractional part or digit separators is not an integer answer and scores 0.
    """
    answers = _ANSWER.findall(response)
    return float(bool(answers) and answers[-1] == ground_truth.strip())


class ArithmeticOptions(TaskConfig):
    """The ``task`` section of ``arithmetic``: its options are in the module docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    seed: NonNegativeInt = 0
    train_size: PositiveInt = 2000
    val_size: PositiveInt = 64
    warmup_steps: NonNegativeInt = 350


def write_parquet(table_rows: list[Mapping[str, Any]], path: Path) -> None:
    """Write next to ``path`` then rename, so a reader never sees a half-written file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        pq.write_table(pa.Table.from_pylist(list(table_rows)), tmp)


class ArithmeticTask(Task):
    name = "arithmetic"
    data_sources = (DATA_SOURCE,)

    Options = ArithmeticOptions

    def prepare(self, directory: Path, options: ArithmeticOptions, progress: bool = True) -> TaskAssets:
        directory = Path(directory)
        data = directory / "data"
        files = {}
        for split in ("train", "val"):
            files[split] = data / f"{split}.parquet"
            if not files[split].exists():
                write_parquet(rows(split, getattr(options, f"{split}_size"), options.seed), files[split])
        model = directory / "model"
        if not model.exists():
            self._build_model(model, options, progress)
        return TaskAssets(train_files=[files["train"]], val_files=[files["val"]], model_path=model)

    def _build_model(self, target: Path, options: ArithmeticOptions, progress: bool) -> None:
        from skip_plugin_arithmetic import tiny_model
        from skip_plugin_arithmetic.calculator import SCHEMA

        seed, steps = options.seed, options.warmup_steps
        log = target.parent / "build.log"
        if progress:
            print(f"building the embedded default's model in {target}: {steps} warm-up steps (progress in {log})")
        conversations = demonstrations(_WARMUP_PROBLEMS, seed)
        tiny_model.build(target, conversations, [SCHEMA], steps=steps, seed=seed, progress=progress, log=log)

    def score(self, response: str, ground_truth: str) -> float:
        return score(response, ground_truth)
