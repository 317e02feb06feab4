"""verl's ``data.custom_cls``: the user's dataset class, built as verl builds it, gives the rows
``RLDataset`` renders; whatever the class does wrong is one line naming the key."""

import json
import re

import pytest
import torch
from click.testing import CliRunner
from skip_core.cli import cli
from skip_core.config import ConfigError
from skip_plugin_trainer.config.sections import DataConfig
from skip_plugin_trainer.data import RLDataset
from word_chat import row, word_tokenizer, write_jsonl

# A verl-style custom class: another file layout ({"q": ..., "a": ...} lines) mapped into verl's
# rows, the chat under raw_prompt as verl's RLHFDataset gives it. It records what it was built with.
QA_CLASS = """
import json
import torch

BUILT = []


class QA(torch.utils.data.Dataset):
    def __init__(self, data_files, tokenizer, config, processor=None, max_samples=-1):
        BUILT.append({"files": list(data_files), "prompt_key": config.get("prompt_key"),
                      "max_prompt_length": config.max_prompt_length, "processor": processor,
                      "max_samples": max_samples, "tokenizer": tokenizer})
        self.rows = []
        for path in data_files:
            with open(path) as lines:
                for line in lines:
                    qa = json.loads(line)
                    self.rows.append({
                        "data_source": "toy",
                        "prompt": "the question as the file had it",
                        "raw_prompt": [{"role": "user", "content": qa["q"]}],
                        "reward_model": {"ground_truth": qa["a"]},
                        "extra_info": {"index": qa["i"]},
                        "dummy_tensor": torch.tensor([0]),
                    })

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if self.rows[i]["reward_model"]["ground_truth"] == "raise":
            raise KeyError("no such row " + "x" * 1000)
        return self.rows[i]


class Broken(QA):
    def __init__(self, **kwargs):
        raise RuntimeError("cannot read\\x1b[31m " + "y" * 1000)


NOT_A_DATASET = dict
"""


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


@pytest.fixture
def custom(tmp_path):
    source = tmp_path / "qa_data.py"
    source.write_text(QA_CLASS)
    rows = [row(i) for i in range(6)]
    lines = [{"q": r["prompt"][0]["content"], "a": str(i), "i": 100 + i} for i, r in enumerate(rows)]
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return source, qa, write_jsonl(tmp_path / "rows.jsonl", rows)


def data(source, name="QA", **keys) -> DataConfig:
    return DataConfig(max_prompt_length=16, custom_cls={"path": str(source), "name": name}, **keys)


def test_the_class_rows_render_as_the_same_rows_read_from_a_file(custom, tokenizer):
    import sys

    source, qa, rows = custom
    mine = RLDataset(str(qa), tokenizer, data(source))
    theirs = RLDataset(rows, tokenizer, DataConfig(max_prompt_length=16))
    assert len(mine) == len(theirs) == 6
    for a, b in zip(mine, theirs, strict=True):
        assert a["raw_prompt_ids"] == b["raw_prompt_ids"]
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert (a["raw_prompt"], a["ground_truth"], a["index"]) == (b["raw_prompt"], b["ground_truth"], b["index"])
    (built,) = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(source)).BUILT
    assert built["files"] == [str(qa)] and built["tokenizer"] is tokenizer
    assert (built["prompt_key"], built["max_prompt_length"], built["processor"], built["max_samples"]) == (
        "prompt",
        16,
        None,
        -1,
    )


@pytest.mark.parametrize(
    ("path", "name", "message"),
    [
        ("absent.py", "QA", r"^data\.custom_cls\.path: no such file '.*absent\.py' \(relative paths"),
        ("qa_data.py", "Missing", r"^data\.custom_cls\.name: .*qa_data\.py has no 'Missing'$"),
        ("qa_data.py", "NOT_A_DATASET", r"^data\.custom_cls\.name: 'NOT_A_DATASET' .* not a class deriving from torch"),
        ("qa_data.py", "Broken", r"^data\.custom_cls: building Broken on data\.train_files failed: RuntimeError: "),
    ],
)
def test_a_class_that_cannot_give_rows_is_one_line_naming_the_key(custom, tokenizer, path, name, message):
    source, qa, _ = custom
    with pytest.raises(ConfigError, match=message) as error:
        RLDataset(str(qa), tokenizer, data(source.parent / path, name))
    text = str(error.value)
    assert "\n" not in text and "\x1b" not in text and len(text) < 500


def test_an_item_that_raises_or_lacks_a_prompt_names_the_item(custom, tokenizer, tmp_path):
    source, qa, _ = custom
    bad = tmp_path / "bad.jsonl"
    bad.write_text(qa.read_text() + json.dumps({"q": "w1", "a": "raise", "i": 7}) + "\n")
    with pytest.raises(ConfigError, match=r"^data\.custom_cls: QA\[6\] \(data\.val_files\) failed: KeyError"):
        RLDataset(str(bad), tokenizer, data(source), files_key="data.val_files")


def test_a_name_is_needed_with_a_path():
    with pytest.raises(ValueError, match="name"):
        DataConfig(custom_cls={"path": "qa_data.py"})


def test_check_imports_the_class_even_before_the_task_is_built(custom, tmp_path, monkeypatch):
    """``--check`` on a task not yet built checks no data, but the user's files it does."""
    monkeypatch.chdir(tmp_path)
    base = ["run", "--check", f"trainer.default_local_dir={tmp_path / 'run'}", f"task.dir={tmp_path / 'task'}"]
    result = CliRunner().invoke(cli, [*base, "data.custom_cls.path=recipe/retool/retool.py", "data.custom_cls.name=X"])
    assert result.exit_code != 0
    assert re.search(r"Error: data\.custom_cls\.path: no such file 'recipe/retool/retool\.py'", result.output)
    result = CliRunner().invoke(cli, [*base, "data.custom_cls.path=qa_data.py", "data.custom_cls.name=QA"])
    assert result.exit_code == 0, result.output
    assert "builds" in result.output and "custom_cls:\n    path: qa_data.py\n    name: QA" in result.output
