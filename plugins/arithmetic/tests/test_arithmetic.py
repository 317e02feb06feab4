import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from itertools import groupby

import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from skip_core import writing
from skip_core.config import ConfigError, parse_section
from skip_core.files import owned
from skip_core.plugins import registry
from skip_plugin_arithmetic import record, tiny_model, warmup
from skip_plugin_arithmetic import task as arithmetic
from skip_plugin_arithmetic.calculator import SCHEMA, evaluate
from skip_plugin_arithmetic.task import (
    ArithmeticOptions,
    ArithmeticTask,
    calls,
    demonstration,
    demonstrations,
    expression_of,
    problems,
    rows,
    score,
)
from skip_plugin_trainer.data.chat import ChatFormat
from skip_plugin_trainer.rollout.tools import HermesParser
from skiptests import assert_umask_modes


def expression(row) -> str:
    return expression_of(row["prompt"][0]["content"])


def play(model, tokenizer, row, temperature: float = 1.0) -> tuple[list[str], str]:
    """One rollout of the protocol with ``generate``, the calculator run after each call: the
    model's turns, and the response as the reward reads it (tool responses included).
    ``temperature`` 0 decodes greedily."""
    chat, parser = ChatFormat(tokenizer), HermesParser()
    ids = chat.prompt_ids(row["prompt"], [SCHEMA])
    start, turns = len(ids), []
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
    for _ in range(3):
        prompt = torch.tensor([ids])
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=48, **sampling)
        ids += out[0, len(ids) :].tolist()
        turns.append(tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True))
        _, calls = parser.parse(turns[-1])
        if not calls:
            break
        try:
            result = evaluate(str(calls[0].arguments.get("expression")))
        except ValueError as exc:
            result = str(exc)
        ids += chat.tool_response_ids([{"role": "tool", "content": result}])
    return turns, tokenizer.decode(ids[start:], skip_special_tokens=True)


# The two endings the warm-up demonstrates: as the prompt asks, or the equation restated.
ANSWERED = re.compile(r"Answer: (-?\d+)")
RESTATED = re.compile(r"[\d()+*\- ]+ = (-?\d+)")


def off_protocol(turns: list[str]) -> str | None:
    """Where ``turns`` leave the protocol of the task's demonstrations, or ``None``: one calculator
    call per turn and nothing else, on an expression the calculator takes, then a last turn that
    answers as the prompt asks (the reward reads its number) or restates the equation (scores 0)."""
    *calling, last = turns
    if not calling:
        return "no calculator call"
    for turn in calling:
        text, calls = HermesParser().parse(turn)
        if text or [call.name for call in calls] != ["calculator"]:
            return f"not one calculator call: {turn!r}"
        try:
            evaluate(str(calls[0].arguments.get("expression")))
        except ValueError as exc:
            return f"the calculator refused {turn!r}: {exc}"
    if answered := ANSWERED.fullmatch(last):
        return None if score(last, answered[1]) == 1.0 else f"the reward does not read {last!r}"
    if restated := RESTATED.fullmatch(last):
        return None if score(last, restated[1]) == 0.0 else f"the reward scores a restatement: {last!r}"
    return f"neither an answer nor the equation: {last!r}"


def test_problems_are_deterministic_per_seed_and_split():
    assert rows("train", 50, seed=3) == rows("train", 50, seed=3)
    assert rows("train", 50, seed=3) != rows("train", 50, seed=4)
    assert [expression(r) for r in rows("train", 50, 3)] != [expression(r) for r in rows("val", 50, 3)]


def test_ground_truths_are_what_the_calculator_says():
    for row in rows("train", 200, seed=0):
        assert row["reward_model"]["ground_truth"] == evaluate(expression(row))


def test_problems_need_the_calculator():
    expressions = [expression(r) for r in rows("train", 200, seed=0)]
    assert {op for e in expressions for op in "+-*" if f" {op} " in e} == set("+-*")
    assert any(e.startswith("(") for e in expressions) and any(not e.startswith("(") for e in expressions)
    assert max(len(evaluate(e)) for e in expressions) >= 7


# Digests of the default task's rows and warm-up demonstrations, taken before long chains existed.
DEFAULT_DIGESTS = {
    "train": "d6c1f5d39abf18471f43c6c4cf0fcd882e92a4f7fdfac9ef61142001c8c09e76",
    "val": "45cc313a602139d7274168487e029b590a7db1633c784fb068a1b1e6da85ac17",
    "warmup": "42a6de3cccb04a7c5294e3195eea54af514d654295edaafc75841b1046bdb6d7",
}


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def test_the_default_options_pose_the_problems_and_demonstrations_they_always_did():
    """No long chains (``long_share`` 0) draws nothing more: the default task's data and the warm-up
    of its model are those of earlier releases, so the default run's numbers stay put."""
    options = ArithmeticOptions()
    shape = (options.seed, options.long_share, options.long_operations)
    assert digest(rows("train", options.train_size, *shape)) == DEFAULT_DIGESTS["train"]
    assert digest(rows("val", options.val_size, *shape)) == DEFAULT_DIGESTS["val"]
    assert digest(demonstrations(arithmetic._WARMUP_PROBLEMS, *shape)) == DEFAULT_DIGESTS["warmup"]


def test_long_chains_are_a_seeded_share_of_the_problems_one_calculator_call_per_operation():
    pairs = problems("train", 2000, 0, long_share=0.15, long_operations=(6, 10))
    assert pairs == problems("train", 2000, 0, long_share=0.15, long_operations=(6, 10))
    assert pairs != problems("train", 2000, 1, long_share=0.15, long_operations=(6, 10))
    operations = Counter(len(calls(*pair)) for pair in pairs)
    assert set(operations) == {1, 2, 6, 7, 8, 9, 10}
    assert 0.13 < sum(operations[n] for n in range(6, 11)) / len(pairs) < 0.17
    for expression, answer in pairs:
        assert evaluate(expression) == answer
        steps = calls(expression, answer)
        assert [evaluate(step) for step, _ in steps] == [result for _, result in steps]
        if len(steps) > 2:  # a product only of a value under 1000: no copied number over 7 digits
            assert max(len(result.lstrip("-")) for _, result in steps) <= 7


def test_a_long_chain_is_demonstrated_one_turn_per_operation():
    expression, answer = next(pair for pair in problems("warmup", 100, 0, 0.5, (8, 8)) if len(calls(*pair)) == 8)
    assert expression.startswith("(" * 7)
    conversation = demonstration(expression, answer)
    turns = [message for message in conversation if message["role"] == "assistant"]
    assert len(turns) == 9 and turns[-1]["content"] == f"Answer: {answer}"
    called = [turn["tool_calls"][0]["function"]["arguments"]["expression"] for turn in turns[:-1]]
    assert called == [step for step, _ in calls(expression, answer)]
    results = [message["content"] for message in conversation if message["role"] == "tool"]
    assert all(call.startswith(result) for call, result in zip(called[1:], results, strict=False))
    assert results[-1] == answer


def test_rows_are_shaped_like_verl():
    row = rows("val", 1, seed=0)[0]
    truth = row["reward_model"]["ground_truth"]
    assert row == {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": f"What is {expression(row)}? Write the result as Answer: <integer>."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {
            "split": "val",
            "index": 0,
            "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": truth}}},
        },
    }


def test_parquet_round_trips_the_rows(tmp_path):
    data = rows("train", 20, seed=0)
    arithmetic.write_parquet(data, tmp_path / "train.parquet")
    assert pq.read_table(tmp_path / "train.parquet").to_pylist() == data
    assert [p.name for p in tmp_path.iterdir()] == ["train.parquet"]


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("Answer: 17834", 1.0),
        ('<tool_call>{"name": "calculator"}</tool_call>tool\n17834assistant\nAnswer: 17834', 1.0),
        ("I think it is 17834.\nAnswer:17834.", 1.0),
        ("Answer: 17 then Answer: 17834", 1.0),
        ("Answer: 17834 no wait Answer: 17833", 0.0),
        ("17834", 0.0),
        ("Answer: 178340", 0.0),
        ("Answer: 17834.5", 0.0),
        ("Answer: 17,834", 0.0),
        ("answer: 17834", 0.0),
        ("", 0.0),
    ],
)
def test_score_is_exact_match_of_the_last_answer(response, expected):
    assert score(response, "17834") == expected


def test_score_reads_negative_answers():
    assert score("Answer: -42", "-42") == 1.0
    assert score("Answer: 42", "-42") == 0.0


def test_options_default_and_validate_naming_the_key():
    assert ArithmeticOptions().model_dump() == {
        "name": None,
        "dir": "runs/embedded",
        "seed": 0,
        "train_size": 2000,
        "val_size": 64,
        "warmup_steps": 350,
        "long_share": 0.0,
        "long_operations": [6, 10],
    }
    options = parse_section(ArithmeticOptions, "task", OmegaConf.create({"name": "arithmetic", "train_size": 10}))
    assert (options.train_size, options.seed, options.name) == (10, 0, "arithmetic")
    with pytest.raises(ConfigError, match=r"^task\.val_size: expected an integer > 0, got 0$"):
        parse_section(ArithmeticOptions, "task", {"val_size": 0})
    with pytest.raises(ConfigError, match=r"^task\.warmup_steps: expected an integer, got 'many'$"):
        parse_section(ArithmeticOptions, "task", {"warmup_steps": "many"})
    with pytest.raises(ConfigError, match=r"^task\.long_share: expected a number, got 'many'$"):
        parse_section(ArithmeticOptions, "task", {"long_share": "many"})
    with pytest.raises(ConfigError, match=r"^task\.long_share: expected a number <= 1\.0, got 1\.5$"):
        parse_section(ArithmeticOptions, "task", {"long_share": 1.5})
    with pytest.raises(ConfigError, match=r"^task\.long_operations\[1\]: expected an integer, got 'x'$"):
        parse_section(ArithmeticOptions, "task", {"long_operations": [6, "x"]})
    ranges = r"expected \[least, most\] with 3 <= least <= most <= 16"
    for bad in ([2, 5], [6], [10, 6], [6, 17]):
        with pytest.raises(ConfigError, match=rf"^task\.long_operations: {ranges}, got {re.escape(str(bad))}$"):
            parse_section(ArithmeticOptions, "task", {"long_operations": bad})
    allowed = r"\(allowed: dir, long_operations, long_share, name, seed, train_size, val_size, warmup_steps\)"
    with pytest.raises(
        ConfigError, match=rf"^task\.trian_size: unknown key {allowed}; did you mean task\.train_size\?$"
    ):
        parse_section(ArithmeticOptions, "task", {"trian_size": 10})


# The options the session's ``tiny_model_dir`` is built with (conftest.py).
SESSION = ArithmeticOptions(train_size=64, val_size=8, warmup_steps=5)


def test_prepare_is_idempotent_and_rebuilds_only_what_is_missing(tiny_model_dir, tmp_path):
    directory = tmp_path / "task"
    shutil.copytree(tiny_model_dir.parent, directory)
    assets = ArithmeticTask().prepare(directory, SESSION, progress=False)
    assert assets.model_path == directory / "model"
    paths = [*assets.train_files, *assets.val_files, *assets.model_path.iterdir()]
    stamps = {path: path.stat().st_mtime_ns for path in paths}

    assert ArithmeticTask().prepare(directory, SESSION, progress=False) == assets
    assert {path: path.stat().st_mtime_ns for path in paths} == stamps

    (val,) = assets.val_files
    val.unlink()
    ArithmeticTask().prepare(directory, SESSION.model_copy(update={"val_size": 3}), progress=False)
    assert len(pq.read_table(val).to_pylist()) == 3
    assert {path: path.stat().st_mtime_ns for path in paths if path != val} == {
        path: stamp for path, stamp in stamps.items() if path != val
    }
    assert json.loads((directory / "task.json").read_text())["data/val.parquet"]["val_size"] == 3


def test_a_directory_built_with_other_options_is_refused_naming_them(tiny_model_dir, tmp_path):
    """``task.long_share`` on the directory of a run without long chains must not train on its
    problems and model: the run stops before any work and says which options differ."""
    directory = tmp_path / "task"
    shutil.copytree(tiny_model_dir.parent, directory)
    stamps = {path: path.stat().st_mtime_ns for path in directory.rglob("*")}
    long_tail = SESSION.model_copy(update={"long_share": 0.15})
    refused = r"^task\.dir: .*/task/data/train\.parquet was built with task\.long_share=0\.0 \(this run: 0\.15\);"
    with pytest.raises(ConfigError, match=refused + " delete it to rebuild it with this run's options"):
        ArithmeticTask().prepare(directory, long_tail, progress=False)
    with pytest.raises(ConfigError, match=r"/model was built with task\.warmup_steps=5 \(this run: 350\)"):
        ArithmeticTask().prepare(directory, SESSION.model_copy(update={"warmup_steps": 350}), progress=False)
    assert {path: path.stat().st_mtime_ns for path in directory.rglob("*")} == stamps


def test_a_directory_built_before_the_record_is_taken_for_the_defaults(tiny_model_dir, tmp_path, monkeypatch):
    directory = tmp_path / "task"
    shutil.copytree(tiny_model_dir.parent, directory)
    (directory / "task.json").unlink()
    unrecorded = r"train\.parquet has no record of the options it was built with .*\(task\.train_size=64\)"
    with pytest.raises(ConfigError, match=unrecorded):
        ArithmeticTask().prepare(directory, SESSION, progress=False)
    assert not (directory / "task.json").exists()

    def read_only(root, relative, text):
        raise PermissionError(root / relative)

    with monkeypatch.context() as patch:  # shared read-only, it is used as it is
        patch.setattr(record.writing, "write_text", read_only)
        ArithmeticTask().prepare(directory, ArithmeticOptions(), progress=False)
    assert not (directory / "task.json").exists()
    ArithmeticTask().prepare(directory, ArithmeticOptions(), progress=False)
    assert json.loads((directory / "task.json").read_text()) == arithmetic.built_with(ArithmeticOptions())


def names_of_a_process_that_exited(*prefixes: str) -> list[str]:
    """``owned(prefix)`` as a process that has since exited wrote them: its pid, this host."""
    code = "import sys; from skip_core.files import owned; print(*map(owned, sys.argv[1:]), sep='\\n')"
    child = subprocess.run([sys.executable, "-c", code, *prefixes], capture_output=True, text=True, check=True)
    return child.stdout.splitlines()


def test_prepare_removes_what_killed_builds_left_and_nothing_else(tiny_model_dir, tmp_path, capsys):
    directory = tmp_path / "task"
    shutil.copytree(tiny_model_dir.parent, directory)
    model, train, record_file = names_of_a_process_that_exited(".model.partial-", ".train.parquet.", ".task.json.")
    leftovers = [directory / f"{model}k3j2", directory / "data" / f"{train}x8.tmp", directory / f"{record_file}q.tmp"]
    leftovers[0].mkdir()
    (leftovers[0] / "config.json").write_text("{}")  # a killed build, weights half written
    for path in leftovers[1:]:
        path.write_bytes(b"PAR1")
    running = directory / f"{owned('.model.partial-')}live"  # a build of this live process
    unmarked = directory / ".model.partial-stale"  # written before names carried their process
    elsewhere = directory / f"{model.replace('@', '@elsewhere', 1)}x"  # another host: its process cannot be asked
    for path in (running, unmarked, elsewhere):
        path.mkdir()

    assets = ArithmeticTask().prepare(directory, SESSION, progress=True)
    assert not any(path.exists() for path in leftovers)
    assert running.is_dir() and unmarked.is_dir() and elsewhere.is_dir()
    assert assets.model_path == directory / "model" and (directory / "data" / "train.parquet").is_file()
    line = f"removed what interrupted builds left: {', '.join(str(path) for path in sorted(leftovers))}"
    assert line in capsys.readouterr().out
    assert (directory / "build.log").read_text().splitlines()[-1].endswith(line)

    ArithmeticTask().prepare(directory, SESSION, progress=True)  # nothing more to remove, nothing said
    assert "removed" not in capsys.readouterr().out


def test_pieces_are_written_under_names_that_say_who_writes_them(tmp_path):
    path = tmp_path / "train.parquet"
    with writing.opened(tmp_path, path.name) as out:
        [tmp] = [name for name in os.listdir(tmp_path) if name != "train.parquet"]
        assert tmp.startswith(owned(".train.parquet."))
        out.write(b"data")
    assert path.read_bytes() == b"data" and os.listdir(tmp_path) == ["train.parquet"]


def test_task_is_registered_by_default():
    task = registry().tasks["arithmetic"]
    assert isinstance(task, ArithmeticTask)
    assert task.data_sources == ("arithmetic",)
    assert task.score("Answer: 5", "5") == 1.0


@pytest.mark.parametrize("graded", [True, False])
def test_a_demonstration_as_a_rollout_calls_one_operation_at_a_time_and_scores_by_its_format(tiny_model_dir, graded):
    """Graded, it ends as the prompt asks and scores 1; otherwise it restates the equation,
    the right number in the wrong form, and scores 0: what RL has to fix."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (row,) = [r for r in rows("val", 8, seed=0) if expression(r).startswith("(")][:1]
    truth = row["reward_model"]["ground_truth"]
    conversation = arithmetic.demonstration(expression(row), truth, graded=graded)
    ids, sampled = warmup.conversation_ids(ChatFormat(tokenizer), conversation, [SCHEMA])
    response = tokenizer.decode(ids[sampled.index(True) :], skip_special_tokens=True)
    calls = [HermesParser().parse(f"{turn}</tool_call>")[1][0] for turn in response.split("</tool_call>")[:-1]]
    results = [evaluate(call.arguments["expression"]) for call in calls]
    assert len(calls) == 2 and results[-1] == truth
    assert calls[1].arguments["expression"].startswith(results[0])
    assert response.endswith(truth) and score(response, truth) == float(graded)


@pytest.mark.parametrize("graded", [True, False])
def test_the_protocol_a_model_is_held_to_is_the_demonstrations(tiny_model_dir, graded):
    """``off_protocol`` passes the warm-up's demonstrations, as a model would write them, and names
    what a turn out of them breaks."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for posed, answer in problems("protocol", 16, seed=0):
        conversation = arithmetic.demonstration(posed, answer, graded=graded)
        ids, sampled = warmup.conversation_ids(ChatFormat(tokenizer), conversation, [SCHEMA])
        runs = groupby(zip(ids, sampled, strict=True), key=lambda pair: pair[1])
        turns = [tokenizer.decode([i for i, _ in run], skip_special_tokens=True) for by_model, run in runs if by_model]
        assert off_protocol(turns) is None
        assert off_protocol(turns[-1:]) == "no calculator call"
        assert off_protocol([turns[0] + " 1", *turns[1:]]).startswith("not one calculator call")
        assert off_protocol([*turns[:-1], turns[-1] + "!"]).startswith("neither an answer nor the equation")


WARM_UP = pytest.mark.skipif(
    not os.environ.get("SKIP_CHECK_WARMUP"), reason="two minutes of CPU; set SKIP_CHECK_WARMUP=1"
)


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    """The embedded default as a run builds it (``warmup_steps`` 350): model, tokenizer, seconds to build."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    assets = ArithmeticTask().prepare(tmp_path_factory.mktemp("default"), ArithmeticOptions(), progress=False)
    built = time.perf_counter() - started
    return (
        AutoModelForCausalLM.from_pretrained(assets.model_path),
        AutoTokenizer.from_pretrained(assets.model_path),
        built,
    )


@WARM_UP
def test_the_model_plays_the_protocol(default_model):
    """Greedy, on 16 validation problems: the calculator called, one operation a turn, then the
    result as the prompt asks or the equation restated. The session's model (5 warm-up steps)
    has not learnt it yet: that one answers greedily with nothing at all."""
    model, tokenizer, _ = default_model
    for row in rows("val", 16, seed=0):
        turns, _ = play(model, tokenizer, row, temperature=0)
        assert off_protocol(turns) is None, f"{expression(row)}: {off_protocol(turns)}"


@WARM_UP
def test_default_warm_up_leaves_room_for_rl(default_model):
    """The default model, measured: usually reaches the right number with the calculator, but
    writes it as the prompt asks only about ``GRADED_SHARE`` of the time."""
    model, tokenizer, built = default_model
    torch.manual_seed(0)
    val = rows("val", 64, seed=0)
    responses = [play(model, tokenizer, row)[1] for row in val]
    truths = [row["reward_model"]["ground_truth"] for row in val]
    reached = sum(text.endswith(truth) for text, truth in zip(responses, truths, strict=True))
    right = sum(score(text, truth) for text, truth in zip(responses, truths, strict=True))
    print(f"built in {built:.0f} s; right number {reached / 64:.0%}, scored {right / 64:.0%} at temperature 1")
    assert reached / 64 >= 0.5
    assert right / 64 <= 0.6 * reached / 64


def test_generated_data_gets_the_umask_modes(tmp_path, umask):
    arithmetic.write_parquet([{"a": 1}], tmp_path / "data" / "train.parquet")
    assert_umask_modes(tmp_path / "data", umask)


def test_the_long_tail_config_fits_its_longest_requests():
    """``skip run --config-name long_tail``: the longest chains it poses, as the warm-up demonstrates
    them (graded or restated), fit its prompt, response and turn limits and the model's positions."""
    from skip_plugin_trainer.commands import compose_config

    config = compose_config(None, "long_tail", ())
    options = parse_section(ArithmeticOptions, "task", config.task)
    most = options.long_operations[1]
    # The build's tokenizer: trained on the first warm-up stage, the default's demonstrations.
    corpus = tiny_model.render(demonstrations(tiny_model.CORPUS_SIZE, options.seed), [SCHEMA])
    tokenizer = tiny_model.build_tokenizer(corpus)
    chat = ChatFormat(tokenizer)
    for expression, answer in problems("longest", 100, options.seed, long_share=1.0, long_operations=(most, most)):
        for graded in (True, False):
            ids, sampled = warmup.conversation_ids(chat, arithmetic.demonstration(expression, answer, graded), [SCHEMA])
            prompt = sampled.index(True)
            assert prompt <= config.data.max_prompt_length
            assert len(ids) - prompt <= config.data.max_response_length
            assert len(ids) <= tokenizer.model_max_length
    assert config.rollout.multi_turn.max_turns > most
