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
- ``long_share`` (number in [0, 1], default 0): the share of problems, in the data and in the
  warm-up alike, that are a long chain ``((a op b) op c) ... op z`` (``chain``) instead: one
  calculator call per operation, so those requests run many more turns and tokens than the
  others, a long tail of request times. 0 draws nothing more: the default problems and model
  are exactly those of earlier releases.
- ``long_operations`` (``[least, most]``, 3 <= least <= most <= 16, default ``[6, 10]``): how
  many operations a long chain has, drawn uniformly.

Assets are built only when missing, under ``task.dir``, and ``task.dir/task.json`` records the
options each was built with (``record``): a run whose options differ from those of a piece
found there stops before any work, naming them; delete the piece (or the directory) to rebuild
it, or set another ``task.dir``. Each piece is written beside its place and renamed into it; what
a killed build left there, each prepare removes once the process that wrote it is gone, and
names in ``task.dir/build.log`` (``leftovers``).
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, NonNegativeInt, PositiveInt, field_validator
from skip_core import writing
from skip_plugin_trainer.config.sections import TaskConfig
from skip_plugin_trainer.tasks import Task, TaskAssets

from skip_plugin_arithmetic import leftovers
from skip_plugin_arithmetic.record import RECORD, BuildRecord

DATA_SOURCE = "arithmetic"

_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_ANSWER = re.compile(r"Answer:\s*(-?\d+)(?![.,]?\d)")
# Warm-up demonstrations come from their own stream so the model never sees the RL prompts.
_WARMUP_SPLIT = "warmup"
_WARMUP_PROBLEMS = 4000
GRADED_SHARE = 0.35
"""How many warm-up demonstrations answer as the prompt asks; the others restate the equation."""
INSTRUCTION = "Write the result as Answer: <integer>."
LONG_OPERATIONS = (6, 10)
"""Operations of a long chain, at least and at most, unless ``task.long_operations`` says otherwise."""
MAX_OPERATIONS = 16
"""The most operations a long chain may have: the prompt of a 16-operation chain (103 tokens at most)
fits the shipped ``data.max_prompt_length`` of 160, its demonstration (632) the model's 1024 positions."""


def problem(
    rng: random.Random, long_share: float = 0.0, long_operations: Sequence[int] = LONG_OPERATIONS
) -> tuple[str, str]:
    """One expression, ``a op b`` or ``(a op b) op c`` with 2 or 3 digit operands, and its value;
    with ``long_share`` > 0, that share of them a long chain instead (``chain``).

    Operands stay below 1000 because copying long numbers is what a one-minute warm-up of a
    tiny model cannot teach; products still reach 9 digits, which only the calculator gets right.
    A ``long_share`` of 0 draws nothing more, so the default task's problems stay what they were.
    """
    if long_share and rng.random() < long_share:
        return chain(rng, rng.randint(*long_operations))
    a, b = _operand(rng), _operand(rng)
    op = rng.choice(tuple(_OPERATORS))
    expression, value = f"{a} {op} {b}", _OPERATORS[op](a, b)
    if rng.random() < 0.5:
        c, op = _operand(rng), rng.choice(tuple(_OPERATORS))
        expression, value = f"({expression}) {op} {c}", _OPERATORS[op](value, c)
    return expression, str(value)


def chain(rng: random.Random, operations: int) -> tuple[str, str]:
    """``((a op b) op c) ... op z``: ``operations`` operations applied left to right, one
    calculator call each, so the request runs ``operations + 1`` turns.

    A product only while the running value has at most 3 digits: every number the model copies
    from a tool response into its next call stays within 7 digits (6, nearly always), however
    long the chain: the length of a request grows with its operations, not with its numbers.
    """
    value = _operand(rng)
    expression = str(value)
    for index in range(operations):
        op = rng.choice(tuple(_OPERATORS) if abs(value) < 1000 else ("+", "-"))
        operand = _operand(rng)
        expression = f"{expression} {op} {operand}" if index == 0 else f"({expression}) {op} {operand}"
        value = _OPERATORS[op](value, operand)
    return expression, str(value)


def _operand(rng: random.Random) -> int:
    digits = rng.randint(2, 3)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def problems(
    split: str, size: int, seed: int, long_share: float = 0.0, long_operations: Sequence[int] = LONG_OPERATIONS
) -> list[tuple[str, str]]:
    # A string seed is hashed the same way in every process, unlike hash(tuple).
    rng = random.Random(f"{DATA_SOURCE}-{split}-{seed}")
    return [problem(rng, long_share, long_operations) for _ in range(size)]


def prompt(expression: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {expression}? {INSTRUCTION}"}]


def expression_of(question: str) -> str:
    """The expression a prompt's question asks about (the inverse of ``prompt``)."""
    return question.removeprefix("What is ").removesuffix(f"? {INSTRUCTION}")


def rows(
    split: str, size: int, seed: int, long_share: float = 0.0, long_operations: Sequence[int] = LONG_OPERATIONS
) -> list[dict[str, Any]]:
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
        for index, (expression, answer) in enumerate(problems(split, size, seed, long_share, long_operations))
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
    ``(a op b) op c`` takes two, the second starting from the first's result, and a chain of
    ``n`` operations ``n``, each starting from the one before's."""
    depth = len(expression) - len(expression.lstrip("("))
    first, *rest = expression[depth:].split(")")
    steps = [(first, str(_apply(first)))]
    for tail in rest:
        step = f"{steps[-1][1]}{tail}"
        steps.append((step, str(_apply(step))))
    if steps[-1][1] != answer:
        raise ValueError(f"{expression} is {steps[-1][1]}, not {answer}")
    return steps


def _apply(expression: str) -> int:
    """The value of ``a op b``, read by splitting, never evaluated as code."""
    a, op, b = expression.split()
    return _OPERATORS[op](int(a), int(b))


def demonstrations(
    size: int, seed: int, long_share: float = 0.0, long_operations: Sequence[int] = LONG_OPERATIONS
) -> list[list[dict[str, Any]]]:
    """The warm-up's conversations: problems of their own split, drawn as the task's are (long
    chains included, so the model learns to see them through), ``GRADED_SHARE`` of them graded."""
    rng = random.Random(f"{DATA_SOURCE}-{_WARMUP_SPLIT}-format-{seed}")
    pairs = problems(_WARMUP_SPLIT, size, seed, long_share, long_operations)
    return [demonstration(*pair, graded=rng.random() < GRADED_SHARE) for pair in pairs]


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
    long_share: float = Field(0.0, ge=0.0, le=1.0)
    long_operations: list[PositiveInt] = Field(default_factory=lambda: list(LONG_OPERATIONS))

    @field_validator("long_operations")
    @classmethod
    def _a_range(cls, value: list[int]) -> list[int]:
        if len(value) != 2 or not 3 <= value[0] <= value[1] <= MAX_OPERATIONS:
            raise ValueError(f"expected [least, most] with 3 <= least <= most <= {MAX_OPERATIONS}, got {value}")
        return value


def built_with(options: ArithmeticOptions) -> dict[str, dict[str, Any]]:
    """The options each piece of the task directory depends on, by its path there (see ``record``)."""
    problems = {"seed": options.seed, "long_share": options.long_share, "long_operations": options.long_operations}
    return {
        "data/train.parquet": {**problems, "train_size": options.train_size},
        "data/val.parquet": {**problems, "val_size": options.val_size},
        "model": {**problems, "warmup_steps": options.warmup_steps},
    }


def write_parquet(table_rows: list[Mapping[str, Any]], path: Path) -> None:
    """Write next to ``path`` then rename, so a reader never sees a half-written file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with writing.opened(path.parent, path.name) as out:
        pq.write_table(pa.Table.from_pylist(list(table_rows)), out)


#: The task directory's log of what building it did: warm-up progress, leftovers removed.
BUILD_LOG = "build.log"


class ArithmeticTask(Task):
    name = "arithmetic"
    data_sources = (DATA_SOURCE,)

    Options = ArithmeticOptions

    def prepare(self, directory: Path, options: ArithmeticOptions, progress: bool = True) -> TaskAssets:
        directory = Path(directory)
        wanted = built_with(options)
        paths = {piece: directory / piece for piece in wanted}
        files = [paths["data/train.parquet"], paths["data/val.parquet"], directory / RECORD]
        removed = leftovers.remove(files=files, directories=[paths["model"]])
        leftovers.say(removed, progress, directory / BUILD_LOG)
        record = BuildRecord(directory, defaults=built_with(ArithmeticOptions()))
        for piece, path in paths.items():
            if path.exists():
                record.check(piece, wanted[piece])
        for split in ("train", "val"):
            piece = f"data/{split}.parquet"
            if not paths[piece].exists():
                size = getattr(options, f"{split}_size")
                write_parquet(
                    rows(split, size, options.seed, options.long_share, options.long_operations), paths[piece]
                )
                record.add(piece, wanted[piece])
        if not paths["model"].exists():
            self._build_model(paths["model"], options, progress)
            record.add("model", wanted["model"])
        return TaskAssets([paths["data/train.parquet"]], [paths["data/val.parquet"]], paths["model"])

    def _build_model(self, target: Path, options: ArithmeticOptions, progress: bool) -> None:
        from skip_plugin_arithmetic import tiny_model
        from skip_plugin_arithmetic.calculator import SCHEMA

        seed, steps = options.seed, options.warmup_steps
        log = target.parent / BUILD_LOG
        then = []
        if options.long_share:
            # The default's warm-up first, which teaches the protocol and the copying of numbers;
            # long chains from the first step delay that past 700 steps. Then as many steps on the
            # task's own mix, batched by length: long chains are several times longer than the rest.
            mix = demonstrations(_WARMUP_PROBLEMS, seed, options.long_share, options.long_operations)
            then.append(tiny_model.Stage(mix, steps, by_length=True, label="warm-up with long chains"))
        if progress:
            more = f", then {steps} with long chains" if then else ""
            print(f"building the embedded default's model in {target}: {steps} warm-up steps{more} (progress in {log})")
        conversations = demonstrations(_WARMUP_PROBLEMS, seed)
        tiny_model.build(target, conversations, [SCHEMA], steps, seed, progress, log, then=then)

    def score(self, response: str, ground_truth: str) -> float:
        return score(response, ground_truth)
