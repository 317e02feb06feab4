"""verl's own dataset class, and a subclass of it as verl's recipes write them, named by
``data.custom_cls``: skip builds them as verl does and renders the rows they give exactly as the
rows it reads from the same file itself."""

from __future__ import annotations

import sys
from pathlib import Path

import datasets
import pytest
import verl.utils.dataset.rl_dataset as verl_rl_dataset
from skip_plugin_trainer.config.sections import DataConfig
from skip_plugin_trainer.data import RLDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))
from word_chat import row, word_tokenizer, write_parquet  # the repository's test helpers

# The recipes' pattern (ReTool's CustomRLHFDataset): verl's class, its rows reshaped.
SUBCLASS = """
from verl.utils.dataset.rl_dataset import RLHFDataset


class WithSystem(RLHFDataset):
    def __getitem__(self, item):
        row = super().__getitem__(item)
        row["raw_prompt"] = [{"role": "system", "content": "w59"}, *row["raw_prompt"]]
        return row
"""


@pytest.fixture
def rows_file(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    return write_parquet(tmp_path / "rows.parquet", [row(i, words=2 + i % 3) for i in range(8)])


def test_verls_own_class_gives_the_rows_skip_reads_itself(rows_file):
    tokenizer = word_tokenizer()
    custom = {"path": verl_rl_dataset.__file__, "name": "RLHFDataset"}
    theirs = RLDataset(str(rows_file), tokenizer, DataConfig(max_prompt_length=16, custom_cls=custom))
    mine = RLDataset(str(rows_file), tokenizer, DataConfig(max_prompt_length=16))
    assert len(theirs) == len(mine) == 8
    for a, b in zip(theirs, mine, strict=True):
        assert a["raw_prompt_ids"] == b["raw_prompt_ids"]
        assert (a["raw_prompt"], a["ground_truth"], a["index"], a["data_source"]) == (
            b["raw_prompt"],
            b["ground_truth"],
            b["index"],
            b["data_source"],
        )


def test_a_subclass_of_verls_class_reshapes_the_rows_skip_renders(rows_file, tmp_path):
    source = tmp_path / "with_system.py"
    source.write_text(SUBCLASS)
    tokenizer = word_tokenizer()
    config = DataConfig(max_prompt_length=24, custom_cls={"path": str(source), "name": "WithSystem"})
    dataset = RLDataset(str(rows_file), tokenizer, config)
    plain = RLDataset(str(rows_file), tokenizer, DataConfig(max_prompt_length=24))
    for a, b in zip(dataset, plain, strict=True):
        assert a["raw_prompt"] == [{"role": "system", "content": "w59"}, *b["raw_prompt"]]
        assert len(a["raw_prompt_ids"]) == len(b["raw_prompt_ids"]) + 4  # <|im_start|> system w59 <|im_end|>
