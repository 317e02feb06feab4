import json
import re

import pytest
import torch
from omegaconf import OmegaConf
from skip_core.config import ConfigError, parse_section
from skip_plugin_trainer.config.sections import DataConfig
from skip_plugin_trainer.data import PromptLoader, RLDataset, collate
from skip_plugin_trainer.data.chat import ChatFormat
from word_chat import OVERHEAD, row, word_tokenizer, write_jsonl, write_parquet

CALC = {"type": "function", "function": {"name": "calc", "description": "add numbers", "parameters": {}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "look up", "parameters": {}}}


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


def config(max_prompt_length: int = 16, **data) -> DataConfig:
    return DataConfig(max_prompt_length=max_prompt_length, **data)


def same_item(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


# -- reading -----------------------------------------------------------------------------------


def test_parquet_and_jsonl_give_the_same_items(tmp_path, tokenizer):
    rows = [row(i, words=i % 4 + 1) for i in range(6)]
    from_parquet = RLDataset(write_parquet(tmp_path / "d.parquet", rows), tokenizer, config())
    from_jsonl = RLDataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, config())
    assert len(from_parquet) == len(from_jsonl) == 6
    assert all(same_item(from_parquet[i], from_jsonl[i]) for i in range(6))


def test_several_files_concatenate_in_order_and_json_suffix_reads_lines(tmp_path, tokenizer):
    first = write_parquet(tmp_path / "a.parquet", [row(0), row(1)])
    second = write_jsonl(tmp_path / "b.json", [row(2)])
    dataset = RLDataset([first, str(second)], tokenizer, config())
    assert [dataset[i]["ground_truth"] for i in range(3)] == ["0", "1", "2"]


def test_item_is_left_padded_with_positions_and_row_fields(tmp_path, tokenizer):
    bare = {"prompt": [{"role": "user", "content": "w1 w2"}], "data_source": "toy"}
    dataset = RLDataset(write_jsonl(tmp_path / "d.jsonl", [row(0), bare]), tokenizer, config(max_prompt_length=10))
    item = dataset[1]
    ids = ChatFormat(tokenizer).prompt_ids(bare["prompt"])
    assert len(ids) == 2 + OVERHEAD
    assert item["raw_prompt_ids"] == ids
    assert item["input_ids"].tolist() == [tokenizer.pad_token_id] * 3 + ids
    assert item["attention_mask"].tolist() == [0, 0, 0] + [1] * 7
    assert item["position_ids"].tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6]
    assert all(item[k].dtype == torch.long for k in ("input_ids", "attention_mask", "position_ids"))
    assert item["raw_prompt"] == bare["prompt"]
    # Absent fields: the row number stands in for the index; no truth, no tools.
    assert (item["index"], item["ground_truth"], item["tools_kwargs"], item["extra_info"]) == (1, None, {}, {})
    first = dataset[0]
    assert (first["index"], first["ground_truth"], first["data_source"]) == (100, "0", "toy")
    assert first["reward_model"] == {"style": "rule", "ground_truth": "0"}


def test_items_are_fresh_copies(tmp_path, tokenizer):
    dataset = RLDataset(write_jsonl(tmp_path / "d.jsonl", [row(0)]), tokenizer, config())
    dataset[0]["raw_prompt"].append({"role": "assistant", "content": "w9"})
    assert len(dataset[0]["raw_prompt"]) == 1


def test_dictconfig_nulls_and_markers_take_the_defaults():
    """verl's YAML writes null for "the default", and carries Hydra markers such as ``_target_``."""
    data = OmegaConf.create({"max_prompt_length": 8, "train_batch_size": 4, "truncation": None, "_target_": "x"})
    parsed = parse_section(DataConfig, "data", data)
    assert (parsed.max_prompt_length, parsed.train_batch_size) == (8, 4)
    assert (parsed.prompt_key, parsed.truncation, parsed.filter_overlong_prompts) == ("prompt", "error", True)


def test_prompt_key_is_configurable(tmp_path, tokenizer):
    rows = [{"question": [{"role": "user", "content": "w1"}]}]
    dataset = RLDataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, config(prompt_key="question"))
    assert dataset[0]["raw_prompt"] == rows[0]["question"]


# -- length: filtering and truncation ----------------------------------------------------------


def test_filter_drops_overlong_prompts_and_reports_it(tmp_path, tokenizer, caplog):
    rows = [row(i, words=n) for i, n in enumerate([1, 5, 2, 9, 3])]  # lengths 6, 10, 7, 14, 8
    caplog.set_level("INFO", logger="skip_plugin_trainer.data")
    dataset = RLDataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, config(max_prompt_length=8))
    assert dataset.dropped == 2
    assert [dataset[i]["index"] for i in range(len(dataset))] == [100, 102, 104]
    assert "dropped 2 of 5 prompts longer than 8 tokens" in caplog.text


def test_all_prompts_filtered_names_max_prompt_length_and_lengths(tmp_path, tokenizer):
    rows = [row(0, words=4), row(1, words=7)]
    with pytest.raises(ConfigError, match=r"data\.max_prompt_length: all 2 prompts .* \(shortest 9, longest 12\)"):
        RLDataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, config(max_prompt_length=8))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("left", lambda full, m: full[-m:]),
        ("right", lambda full, m: full[:m]),
        ("middle", lambda full, m: full[: m // 2] + full[-(m - m // 2) :]),
    ],
)
def test_truncation_modes(tmp_path, tokenizer, mode, expected):
    path = write_jsonl(tmp_path / "d.jsonl", [row(0, words=10), row(1, words=0)])
    full = RLDataset(path, tokenizer, config(max_prompt_length=64))[0]["raw_prompt_ids"]
    assert len(full) == 15
    for limit in (5, 6):
        data = config(max_prompt_length=limit, filter_overlong_prompts=False, truncation=mode)
        dataset = RLDataset(path, tokenizer, data)
        assert dataset[0]["raw_prompt_ids"] == expected(full, limit)
        assert dataset[0]["input_ids"].tolist() == expected(full, limit)
        assert dataset[0]["attention_mask"].all()
        assert len(dataset[1]["raw_prompt_ids"]) == OVERHEAD  # short prompts are left alone


def test_middle_truncation_keeps_first_and_last_halves(tmp_path, tokenizer):
    data = config(max_prompt_length=5, filter_overlong_prompts=False, truncation="middle")
    dataset = RLDataset(write_jsonl(tmp_path / "d.jsonl", [row(0, words=4)]), tokenizer, data)
    tokens = tokenizer.convert_ids_to_tokens(dataset[0]["raw_prompt_ids"])
    assert tokens == ["<|im_start|>", "user", "<|im_end|>", "<|im_start|>", "assistant"]


def test_error_truncation_names_row_and_length(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [row(0), row(1, words=6)])
    with pytest.raises(ConfigError, match=r"d\.jsonl, line 2: the prompt has 11 tokens.*max_prompt_length=8"):
        RLDataset(path, tokenizer, config(max_prompt_length=8, filter_overlong_prompts=False))


# -- errors ------------------------------------------------------------------------------------


def test_missing_file_names_key_and_path(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match=r"data\.train_files: no such file .*nope\.parquet"):
        RLDataset(tmp_path / "nope.parquet", tokenizer, config())


def test_bad_suffix_names_file_and_allowed_suffixes(tmp_path, tokenizer):
    path = tmp_path / "d.csv"
    path.write_text("prompt\n")
    with pytest.raises(ConfigError, match=r"data\.val_files: .*d\.csv.*\.parquet, \.jsonl, \.json"):
        RLDataset([path], tokenizer, config(), files_key="data.val_files")


def test_row_without_prompt_names_file_and_row(tmp_path, tokenizer):
    rows = [row(0), {"question": [{"role": "user", "content": "w1"}], "data_source": "toy"}]
    with pytest.raises(ConfigError, match=r"d\.parquet, row 1: no prompt column 'prompt' \(data\.prompt_key\)"):
        RLDataset(write_parquet(tmp_path / "d.parquet", rows), tokenizer, config())


def test_bad_json_line_is_named(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row(0)) + "\n\n{oops\n")
    with pytest.raises(ConfigError, match=r"d\.jsonl, line 3: not JSON"):
        RLDataset(path, tokenizer, config())


@pytest.mark.parametrize(
    ("cut", "message"),
    [(0, "Parquet file size is 0 bytes"), (300, "Parquet magic bytes not found"), (None, "")],
)
def test_an_empty_or_cut_short_parquet_file_is_one_line_naming_it(tmp_path, tokenizer, cut, message):
    path = tmp_path / "d.parquet"
    whole = write_parquet(tmp_path / "whole.parquet", [row(0)]).read_bytes()
    path.write_bytes(b"not parquet at all" if cut is None else whole[:cut])
    where = re.escape(str(path))
    with pytest.raises(ConfigError, match=rf"^{where}: not a parquet file pyarrow can read \(.*{message}"):
        RLDataset(path, tokenizer, config())


def test_a_json_line_nested_past_what_skip_reads_is_one_line(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": ' * 5000 + "1" + "}" * 5000 + "\n")  # json.loads would end in a RecursionError
    with pytest.raises(ConfigError, match=r"d\.jsonl, line 1: not JSON \(nested 5000 levels deep, more than the 100"):
        RLDataset(path, tokenizer, config())


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"truncation": "mid"}, "data.truncation: expected 'left', 'right', 'middle' or 'error', got 'mid'"),
        ({"max_prompt_length": 0}, "data.max_prompt_length: expected an integer > 0, got 0"),
        ({"max_prompt_length": "8"}, "data.max_prompt_length: expected an integer, got '8'"),
        ({"filter_overlong_prompts": "yes"}, "data.filter_overlong_prompts: expected true or false, got 'yes'"),
        ({"prompt_key": ""}, "data.prompt_key: expected at least 1 character, got ''"),
    ],
)
def test_bad_config_values_name_the_key(data, message):
    with pytest.raises(ConfigError) as exc:
        parse_section(DataConfig, "data", {"max_prompt_length": 8, **data})
    assert str(exc.value) == message


# -- tools -------------------------------------------------------------------------------------


def tool_names(tokenizer, ids: list[int]) -> list[str]:
    return [t for t in tokenizer.convert_ids_to_tokens(ids) if t in ("calc", "search")]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_tools_rendered_only_for_tools_named_in_tools_kwargs(tmp_path, tokenizer, fmt):
    # In parquet the tools_kwargs struct unites all rows' keys; the nulls must not count as tools.
    # Tools render in tools_kwargs order, as the agent loop lists them (parquet: the struct's order).
    rows = [
        row(0, tools={"calc": {"create_kwargs": {"x": 1}}}),
        row(1),
        row(2, tools={"calc": {"create_kwargs": {"x": 3}}, "search": {"execute_kwargs": {"k": 2}}}),
    ]
    write = write_parquet if fmt == "parquet" else write_jsonl
    path = write(tmp_path / f"d.{fmt}", rows)
    dataset = RLDataset(path, tokenizer, config(max_prompt_length=32), {"calc": CALC, "search": SEARCH})
    assert [tool_names(tokenizer, dataset[i]["raw_prompt_ids"]) for i in range(3)] == [["calc"], [], ["calc", "search"]]
    assert dataset[0]["tools_kwargs"] == {"calc": {"create_kwargs": {"x": 1}}}
    assert dataset[2]["tools_kwargs"]["search"] == {"execute_kwargs": {"k": 2}}
    assert len(dataset[0]["raw_prompt_ids"]) == 3 + OVERHEAD + 5 + 1
    untooled = RLDataset(path, tokenizer, config(max_prompt_length=32))
    assert tool_names(tokenizer, untooled[2]["raw_prompt_ids"]) == []


def test_unknown_tool_names_tool_and_row(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [row(0), row(1, tools={"search": {}})])
    with pytest.raises(ConfigError, match=r"line 2: .*tool 'search', which is not configured \(tools: calc\)"):
        RLDataset(path, tokenizer, config(), {"calc": CALC})


# -- collate -----------------------------------------------------------------------------------


def test_collate_stacks_tensors_and_keeps_rows_as_objects(tmp_path, tokenizer):
    rows = [row(0, words=1), row(1, words=3, tools={"calc": {}}), row(2, words=2)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    dataset = RLDataset(path, tokenizer, config(max_prompt_length=16), {"calc": CALC})
    batch = collate([dataset[i] for i in range(3)])
    assert len(batch) == 3
    assert {k: tuple(v.shape) for k, v in batch.batch.items()} == {
        "input_ids": (3, 16),
        "attention_mask": (3, 16),
        "position_ids": (3, 16),
    }
    assert batch.batch["attention_mask"].sum(dim=1).tolist() == [6, 14, 7]
    assert (batch.batch["input_ids"][:, :2] == tokenizer.pad_token_id).all()  # left padding
    for key, array in batch.non_tensor_batch.items():
        assert array.dtype == object and array.shape == (3,), key
    assert batch.non_tensor_batch["raw_prompt"][1] == rows[1]["prompt"]
    assert batch.non_tensor_batch["raw_prompt_ids"][0] == dataset[0]["raw_prompt_ids"]
    assert list(batch.non_tensor_batch["index"]) == [100, 101, 102]
    assert batch.meta_info == {}


# -- loader ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ten(tmp_path_factory, tokenizer):
    path = write_jsonl(tmp_path_factory.mktemp("ten") / "d.jsonl", [row(i) for i in range(10)])
    return RLDataset(path, tokenizer, config())


def indices(batch) -> list[int]:
    return [int(i) - 100 for i in batch.non_tensor_batch["index"]]


def epoch_order(loader) -> list[int]:
    return [i for batch in loader for i in indices(batch)]


def test_drop_last_sets_batches_per_epoch(ten):
    assert len(PromptLoader(ten, 3)) == 3
    loader = PromptLoader(ten, 3, drop_last=False, shuffle=False)
    assert len(loader) == 4
    assert [indices(b) for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_batch_size_larger_than_dataset_names_train_batch_size(ten):
    with pytest.raises(ConfigError, match=r"data\.train_batch_size: 11 is more than the 10 prompts"):
        PromptLoader(ten, 11)
    assert len(PromptLoader(ten, 11, drop_last=False)) == 1


def test_shuffle_is_a_deterministic_permutation_per_epoch(ten):
    loader = PromptLoader(ten, 5, seed=7)
    epochs = [epoch_order(loader) for _ in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]
    again = PromptLoader(ten, 5, seed=7)
    assert [epoch_order(again) for _ in range(3)] == epochs
    assert epoch_order(PromptLoader(ten, 5, seed=8)) != epochs[0]


def test_for_loop_runs_one_epoch_and_next_runs_on(ten):
    loader = PromptLoader(ten, 3, seed=1)
    first = [indices(b) for b in loader]
    assert len(first) == 3 and (loader.epoch, loader.position) == (1, 0)
    stream = PromptLoader(ten, 3, seed=1)
    assert [indices(next(stream)) for _ in range(6)][:3] == first
    assert (stream.epoch, stream.position) == (2, 0)


@pytest.mark.parametrize("consumed", [2, 3, 4])  # mid-epoch, at the boundary, into the next epoch
def test_resume_gives_the_uninterrupted_sequence(ten, consumed):
    reference = PromptLoader(ten, 3, seed=5)
    uninterrupted = [indices(next(reference)) for _ in range(8)]
    interrupted = PromptLoader(ten, 3, seed=5)
    head = [indices(next(interrupted)) for _ in range(consumed)]
    state = json.loads(json.dumps(interrupted.state_dict()))
    assert state["epoch"] == consumed // 3 and state["position"] == consumed % 3
    resumed = PromptLoader(ten, 3, seed=5)
    resumed.load_state_dict(state)
    rest_of_epoch = [indices(b) for b in resumed]
    tail = rest_of_epoch + [indices(next(resumed)) for _ in range(8 - consumed - len(rest_of_epoch))]
    assert head + tail == uninterrupted


def test_resume_with_other_settings_is_refused(ten):
    state = PromptLoader(ten, 3, seed=5).state_dict()
    with pytest.raises(ConfigError, match="checkpoint has batch_size=3, this run has 2"):
        PromptLoader(ten, 2, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="bad epoch 0 or position 3"):
        PromptLoader(ten, 3, seed=5).load_state_dict({**state, "position": 3})


def test_tokenizes_a_few_thousand_rows_quickly(tmp_path, tokenizer):
    rows = [row(i, words=i % 20 + 1) for i in range(3000)]
    path = write_parquet(tmp_path / "d.parquet", rows)
    dataset = RLDataset(path, tokenizer, config(max_prompt_length=32))
    assert len(dataset) == 3000
    assert dataset[-1]["attention_mask"].sum().item() == 20 + OVERHEAD


@pytest.mark.parametrize("media", ["images", "videos"])
def test_a_row_with_images_or_videos_is_refused_naming_it(tmp_path, tokenizer, media):
    rows = [row(0, **{media: None}), row(1, **{media: [{"bytes": b"\x89PNG"}]})]
    with pytest.raises(ConfigError, match=rf"rows\.parquet, row 1: the row has {media}; skip reads text prompts only"):
        RLDataset(write_parquet(tmp_path / "rows.parquet", rows), tokenizer, config())
