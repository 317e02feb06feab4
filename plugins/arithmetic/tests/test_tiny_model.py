import hashlib
import json
import subprocess
import sys

import pytest
import skip_core.progress
import torch
from safetensors.torch import load_file
from skip_plugin_arithmetic import tiny_model, warmup
from skip_plugin_arithmetic.calculator import SCHEMA
from skip_plugin_arithmetic.task import demonstration, problems
from skip_plugin_trainer.data.chat import ChatFormat
from skip_plugin_trainer.rollout.tools import HermesParser, ToolCall

CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "482 * 37"}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def conversations():
    return [demonstration(*pair) for pair in problems("test", 64, seed=0)]


def render(tokenizer, messages, tools=None, generate=False) -> str:
    return ChatFormat(tokenizer).render(messages, tools, generate=generate)


@pytest.mark.parametrize("marker", [tiny_model.PAD, tiny_model.IM_START, tiny_model.IM_END, *tiny_model.TOOL_TAGS])
def test_markers_are_single_tokens(tokenizer, marker):
    assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1


def test_tool_tags_survive_skipping_special_tokens(tokenizer):
    text = "<|im_start|>assistant\n<tool_call>{}</tool_call><tool_response>7</tool_response><|im_end|>"
    decoded = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert decoded == "assistant\n<tool_call>{}</tool_call><tool_response>7</tool_response>"


def test_end_of_turn_and_padding_tokens(tokenizer):
    assert (tokenizer.eos_token, tokenizer.pad_token) == (tiny_model.IM_END, tiny_model.PAD)


def test_every_digit_is_its_own_token(tokenizer):
    ids = tokenizer.encode("What is (9075 - 12) * 3?", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("9075123")


def test_turns_have_no_newline_after_end_of_turn(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Answer: 1"}]
    text = render(tokenizer, messages)
    assert text == "<|im_start|>user\nhi<|im_end|><|im_start|>assistant\nAnswer: 1<|im_end|>"
    assert render(tokenizer, messages[:1], generate=True) == "<|im_start|>user\nhi<|im_end|><|im_start|>assistant\n"


def test_tools_go_in_one_system_turn_with_the_system_message(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = render(tokenizer, messages, [SCHEMA])
    system, user = text.split("<|im_end|>")[:2]
    assert system.startswith("<|im_start|>system\nBe brief.\n")
    tools = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(tools) == SCHEMA
    assert user == "<|im_start|>user\nhi"
    assert text.count("<|im_start|>system") == 1


def test_system_message_without_tools_renders_as_a_turn(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert render(tokenizer, messages) == "<|im_start|>system\nBe brief.<|im_end|><|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("arguments", [{"expression": "482 * 37"}, '{"expression": "482 * 37"}'])
def test_tool_calls_render_as_parseable_hermes_calls(tokenizer, arguments):
    call = {"type": "function", "function": {"name": "calculator", "arguments": arguments}}
    text = render(
        tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    )
    assistant = text.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>")
    assert HermesParser().parse(assistant) == ("", [ToolCall("calculator", {"expression": "482 * 37"})])


def test_tool_responses_render_in_a_tool_turn(tokenizer):
    text = render(tokenizer, [{"role": "user", "content": "x"}, {"role": "tool", "content": "17834"}])
    assert text.endswith("<|im_start|>tool\n<tool_response>17834</tool_response><|im_end|>")


def test_chat_format_pieces_are_the_full_conversation(tokenizer):
    chat = ChatFormat(tokenizer)
    user = {"role": "user", "content": "What is 482 * 37?"}
    call = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    tool = {"role": "tool", "content": "17834"}
    answer = {"role": "assistant", "content": "Answer: 17834"}
    pieces = chat.prompt_ids([user], [SCHEMA]) + chat.assistant_ids(call)
    pieces += chat.tool_response_ids([tool]) + chat.assistant_ids(answer)
    full = tokenizer.apply_chat_template([user, call, tool, answer], tools=[SCHEMA], tokenize=False)
    assert pieces == tokenizer.encode(full, add_special_tokens=False)


def test_conversation_ids_mark_only_what_the_model_writes(tokenizer):
    conversation = demonstration("(12 + 5) * 3", "51")
    ids, sampled = warmup.conversation_ids(ChatFormat(tokenizer), conversation, [SCHEMA])
    written = tokenizer.decode([i for i, s in zip(ids, sampled, strict=True) if s])
    calls = [json.dumps({"name": "calculator", "arguments": {"expression": e}}) for e in ("12 + 5", "17 * 3")]
    assert written == "".join(f"<tool_call>{call}</tool_call><|im_end|>" for call in calls) + "Answer: 51<|im_end|>"


def test_saved_directory_is_an_ordinary_hf_model(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert (tiny_model_dir / "model.safetensors").is_file()
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids(tiny_model.IM_END)
    prompt = torch.tensor([ChatFormat(tokenizer).prompt_ids([{"role": "user", "content": "What is 1 + 2?"}], [SCHEMA])])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt.shape[1]


def test_build_is_atomic(tmp_path, conversations, monkeypatch, capsys):
    target = tmp_path / "model"
    stale = tmp_path / ".model.partial-stale"  # a killed earlier build, from before names said whose
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    code = "from skip_core.files import owned; print(owned('.model.partial-'))"
    exited = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    killed_build = tmp_path / f"{exited}a1b2"  # a killed build of a process that is gone: removed
    killed_build.mkdir()

    def killed(*args, **kwargs):
        raise RuntimeError("killed")

    with monkeypatch.context() as patch:
        patch.setattr(tiny_model, "warm_up", killed)
        with pytest.raises(RuntimeError, match="killed"):
            tiny_model.build(target, conversations, [SCHEMA], steps=1, progress=True, log=tmp_path / "build.log")
    assert sorted(p.name for p in tmp_path.iterdir()) == [stale.name, "build.log"]
    assert f"removed what interrupted builds left: {killed_build}" in capsys.readouterr().out
    assert str(killed_build) in (tmp_path / "build.log").read_text()
    (tmp_path / "build.log").unlink()

    tiny_model.build(target, conversations, [SCHEMA], steps=0, progress=False)
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in target.iterdir()
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == [stale.name, "model"]


def test_warm_up_lowers_the_loss_on_unseen_conversations(conversations):
    tokenizer = tiny_model.build_tokenizer(tiny_model.render(conversations, [SCHEMA]))
    model = tiny_model.build_model(tokenizer, seed=0)
    chat = ChatFormat(tokenizer)
    held_out = warmup._collate(
        [warmup.conversation_ids(chat, c, [SCHEMA]) for c in conversations[48:]], tokenizer.pad_token_id
    )

    def loss() -> float:
        with torch.no_grad():
            return model(**held_out).loss.item()

    before = loss()
    warmup.warm_up(model, tokenizer, conversations[:48], [SCHEMA], steps=12, batch_size=8, progress=False)
    assert loss() < 0.6 * before


def test_warm_up_progress_without_a_terminal_is_plain_lines_on_stdout_and_in_the_log(
    conversations, tmp_path, monkeypatch, capsys
):
    """Output to a file (CI, nohup) gets periodic lines instead of a bar that shows only at the end."""
    monkeypatch.setattr(skip_core.progress, "EVERY_S", 0.0)
    tokenizer = tiny_model.build_tokenizer(tiny_model.render(conversations, [SCHEMA]))
    model = tiny_model.build_model(tokenizer, seed=0)
    log = tmp_path / "build.log"
    warmup.warm_up(model, tokenizer, conversations, [SCHEMA], steps=3, batch_size=4, log=log)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in printed] == [f"warm-up {k}/3 steps" for k in (1, 2, 3, 3)]
    assert "s left" in printed[0] and "s left" not in printed[-1]
    logged = log.read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in logged] == printed  # the same lines, after a date and time


def test_warm_up_batches_are_those_of_earlier_releases():
    """The default build's batches, digested before batching by length existed: its model is unchanged."""
    batches = warmup._batches(4000, 32, 350, seed=0)
    assert hashlib.sha256(json.dumps(batches).encode()).hexdigest() == (
        "21bfed773727090d5eb632a9777516b8c293fa693815cc34196792d02c7613d3"
    )


def test_batches_by_length_hold_the_same_examples_each_stretch_padded_less():
    lengths = [300 if i % 7 == 0 else 80 + i % 20 for i in range(1000)]
    plain = warmup._batches(1000, 8, 40, seed=0)
    by_length = warmup._batches(1000, 8, 40, seed=0, lengths=lengths)
    assert by_length == warmup._batches(1000, 8, 40, seed=0, lengths=lengths)
    assert [len(batch) for batch in by_length] == [8] * 40
    stretch = warmup.BUCKET

    def examples(batches, start):
        return sorted(i for batch in batches[start : start + stretch] for i in batch)

    def padded(batches):
        return sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)

    assert all(examples(plain, start) == examples(by_length, start) for start in range(0, 40, stretch))
    assert padded(by_length) < 0.6 * padded(plain)


def test_a_build_with_a_further_stage_starts_as_the_build_without_it(tmp_path, conversations, capsys):
    more = tiny_model.Stage(conversations[::-1], steps=2, by_length=True, label="warm-up with long chains")
    tiny_model.build(tmp_path / "one", conversations, [SCHEMA], steps=2, progress=False)
    tiny_model.build(tmp_path / "two", conversations, [SCHEMA], steps=2, progress=False, then=[more])
    assert (tmp_path / "one/tokenizer.json").read_text() == (tmp_path / "two/tokenizer.json").read_text()
    one, two = (load_file(tmp_path / name / "model.safetensors") for name in ("one", "two"))
    assert one.keys() == two.keys() and any(not torch.equal(one[key], two[key]) for key in one)
