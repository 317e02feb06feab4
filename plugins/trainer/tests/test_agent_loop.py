"""The agent loop's state machine, driven by a scripted model.

``ScriptedBackend`` is a test double of the *model* only: it answers each turn with text a
script chooses, encoded by the real tokenizer. The loop, chat format, parser, tools and
padding under test are the real ones.
"""

import asyncio
import threading

import pytest
import torch
from scripted_model import ScriptedBackend, call, make_loop, prompts
from skip_core import SkipManager
from skip_core.backend import Generation
from skip_plugin_trainer.data.chat import ChatFormat
from skip_plugin_trainer.rollout.agent_loop import RolloutError
from skip_plugin_trainer.rollout.tools import Tool, ToolResponse
from skiptests import run_config
from transformers import AutoTokenizer

RECORDER_SCHEMA = {"type": "function", "function": {"name": "recorder", "parameters": {"type": "object"}}}


class Recorder(Tool):
    """A tool that logs its lifecycle; ``fail`` makes execute raise, ``pause`` makes it wait."""

    schema = RECORDER_SCHEMA

    def __init__(self, fail=False, pause=0.0):
        super().__init__()
        self.fail, self.pause, self.events, self.running, self.peak = fail, pause, [], 0, 0

    async def create(self, request_id, **kwargs):
        self.events.append(("create", kwargs))

    async def execute(self, request_id, arguments, **kwargs):
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(self.pause)
        self.running -= 1
        if self.fail:
            raise ValueError("the recorder broke")
        self.events.append(("execute", arguments, kwargs))
        return ToolResponse(f"recorded {arguments.get('x')}")

    async def calc_reward(self, request_id, **kwargs):
        self.events.append(("calc_reward", kwargs))
        return kwargs.get("bonus", 0.5)

    async def release(self, request_id, **kwargs):
        self.events.append(("release", kwargs))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def segments(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(value, run length) of each run in a 1-d 0/1 mask, padding included."""
    runs, values = [], mask.tolist()
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return [tuple(r) for r in runs]


def test_tool_calls_over_several_turns(tokenizer):
    script = {0: call("12 * 34"), 1: call("408 + 1"), 2: "Answer: 409"}
    backend = ScriptedBackend(tokenizer, lambda q, turn: script[turn])
    loop = make_loop(tokenizer, backend)
    out = loop.generate_sequences(prompts(tokenizer, ["What is 12 * 34 + 1?"]))
    loop.shutdown()

    assert out.non_tensor_batch["num_turns"].tolist() == [3]
    assert out.non_tensor_batch["tool_calls"].tolist() == [2]
    assert out.non_tensor_batch["finish_reason"].tolist() == ["stop"]
    messages = out.non_tensor_batch["messages"][0]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["408", "409"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    assert messages[-1]["content"] == "Answer: 409"

    # Model turns are masked in, tool responses out, then right padding.
    chat = ChatFormat(tokenizer)
    turn = [len(tokenizer.encode(script[k], add_special_tokens=False)) + 1 for k in range(3)]
    tool = [len(chat.tool_response_ids([{"role": "tool", "content": v}])) for v in ("408", "409")]
    used = sum(turn) + sum(tool)
    mask = out.batch["response_mask"][0]
    assert segments(mask) == [(1, turn[0]), (0, tool[0]), (1, turn[1]), (0, tool[1]), (1, turn[2]), (0, 256 - used)]
    assert out.batch["attention_mask"][0, 64:].sum() == used
    log_probs = out.batch["rollout_log_probs"][0]
    assert torch.all((log_probs != 0) == mask.bool())
    assert log_probs[0].item() == pytest.approx(-0.25)
    response = tokenizer.decode(out.batch["responses"][0, :used])
    assert response.count("<tool_response>") == 2 and response.endswith("Answer: 409<|im_end|>")


def test_batch_layout_is_left_padded_prompts_and_continuing_positions(tokenizer):
    backend = ScriptedBackend(tokenizer, lambda q, turn: "Answer: 1")
    loop = make_loop(tokenizer, backend)
    batch = prompts(tokenizer, ["short?", "a somewhat longer question?"])
    out = loop.generate_sequences(batch)
    loop.shutdown()
    for i, ids in enumerate(batch.non_tensor_batch["raw_prompt_ids"]):
        row = out.batch["prompts"][i]
        assert row[64 - len(ids) :].tolist() == ids
        assert out.batch["attention_mask"][i, : 64 - len(ids)].sum() == 0
        positions = out.batch["position_ids"][i]
        assert positions[63].item() == len(ids) - 1
        assert positions[64:67].tolist() == [len(ids), len(ids) + 1, len(ids) + 2]
    assert torch.equal(out.batch["input_ids"], torch.cat([out.batch["prompts"], out.batch["responses"]], 1))


def test_malformed_call_ends_the_turn_as_plain_text(tokenizer):
    text = '<tool_call>{"name": calculator, "arguments": {}}</tool_call>'
    backend = ScriptedBackend(tokenizer, lambda q, turn: text)
    loop = make_loop(tokenizer, backend)
    out = loop.generate_sequences(prompts(tokenizer, ["What is 1 + 1?"]))
    loop.shutdown()
    assert out.non_tensor_batch["num_turns"].tolist() == [1]
    assert out.non_tensor_batch["tool_calls"].tolist() == [0]
    assert out.non_tensor_batch["finish_reason"].tolist() == ["stop"]
    assert out.non_tensor_batch["messages"][0][-1] == {"role": "assistant", "content": text}


def test_max_turns_stops_a_model_that_keeps_calling(tokenizer):
    backend = ScriptedBackend(tokenizer, lambda q, turn: call(f"{turn} + 1"))
    loop = make_loop(tokenizer, backend, multi_turn={"max_turns": 2})
    out = loop.generate_sequences(prompts(tokenizer, ["loop forever"]))
    loop.shutdown()
    assert out.non_tensor_batch["num_turns"].tolist() == [2]
    assert out.non_tensor_batch["tool_calls"].tolist() == [2]
    assert out.non_tensor_batch["finish_reason"].tolist() == ["max_turns"]


def test_max_user_turns_ends_a_request_after_that_many_rounds_of_tool_responses(tokenizer):
    """verl's max_user_turns: the request ends with the tool responses of the last round allowed."""
    backend = ScriptedBackend(tokenizer, lambda q, turn: call(f"{turn} + 1"))
    loop = make_loop(tokenizer, backend, multi_turn={"max_turns": 4, "max_user_turns": 1})
    out = loop.generate_sequences(prompts(tokenizer, ["loop forever"]))
    loop.shutdown()
    assert out.non_tensor_batch["num_turns"].tolist() == [1] and out.non_tensor_batch["tool_calls"].tolist() == [1]
    assert out.non_tensor_batch["finish_reason"].tolist() == ["max_turns"]
    assert out.non_tensor_batch["messages"][0][-1]["role"] == "tool"


def test_response_length_limits_each_engine_call_and_truncates(tokenizer):
    backend = ScriptedBackend(tokenizer, lambda q, turn: call("2 ** 10") if turn == 0 else "Answer: " + "9" * 300)
    loop = make_loop(tokenizer, backend, response_length=160)
    out = loop.generate_sequences(prompts(tokenizer, ["big"]))
    loop.shutdown()
    first, second = backend.params
    assert first.max_new_tokens == 160
    assert second.max_new_tokens < 160  # what the first turn and the tool response left
    assert out.non_tensor_batch["finish_reason"].tolist() == ["length"]
    assert out.batch["attention_mask"][0, 64:].sum() == 160  # filled exactly, never beyond


def test_max_model_len_bounds_prompt_plus_response(tokenizer):
    backend = ScriptedBackend(tokenizer, lambda q, turn: "Answer: " + "7" * 400)
    loop = make_loop(tokenizer, backend, max_model_len=40)
    batch = prompts(tokenizer, ["q"])
    out = loop.generate_sequences(batch)
    loop.shutdown()
    prompt_len = len(batch.non_tensor_batch["raw_prompt_ids"][0])
    assert backend.params[0].max_new_tokens == 40 - prompt_len - 1
    assert out.non_tensor_batch["finish_reason"].tolist() == ["length"]
    assert out.batch["attention_mask"][0].sum() < 40


def test_prompt_over_prompt_length_fails_the_batch_naming_it(tokenizer):
    loop = make_loop(tokenizer, ScriptedBackend(tokenizer, lambda q, t: "x"), prompt_length=4)
    with pytest.raises(RolloutError, match="exceeds prompt_length 4"):
        loop.generate_sequences(prompts(tokenizer, ["a long enough question"]))
    loop.shutdown()


@pytest.mark.loaded
def test_output_is_ordered_by_prompt_then_sample(tokenizer):
    questions = [f"question {i}" for i in range(6)]
    backend = ScriptedBackend(
        tokenizer, lambda q, turn: f"Answer: {q}", delay=lambda q: 0.05 * (6 - int(q.split()[-1]))
    )
    loop = make_loop(tokenizer, backend, n=3)
    out = loop.generate_sequences(prompts(tokenizer, questions))
    loop.shutdown()
    answers = [m[-1]["content"] for m in out.non_tensor_batch["messages"]]
    assert answers == [f"Answer: {q}" for q in questions for _ in range(3)]
    seeds = [p.seed for p in backend.params]
    assert len(set(seeds)) == 18  # every sample draws from its own seed


def test_a_raising_tool_answers_with_the_error_and_the_rollout_goes_on(tokenizer):
    tool = Recorder(fail=True)
    script = {0: '<tool_call>{"name": "recorder", "arguments": {"x": 1}}</tool_call>', 1: "Answer: done"}
    backend = ScriptedBackend(tokenizer, lambda q, turn: script[turn])
    loop = make_loop(tokenizer, backend, tools={"recorder": tool})
    out = loop.generate_sequences(prompts(tokenizer, ["q"], tools_kwargs={"recorder": {}}))
    loop.shutdown()
    messages = out.non_tensor_batch["messages"][0]
    assert messages[2] == {"role": "tool", "content": "Error: the recorder broke"}
    assert out.non_tensor_batch["finish_reason"].tolist() == ["stop"]
    assert out.non_tensor_batch["num_turns"].tolist() == [2]


@pytest.mark.loaded
def test_tool_lifecycle_uses_per_sample_kwargs_and_runs_calls_concurrently(tokenizer):
    tool = Recorder(pause=0.1)
    two_calls = "".join(f'<tool_call>{{"name": "recorder", "arguments": {{"x": {x}}}}}</tool_call>' for x in (1, 2))
    backend = ScriptedBackend(tokenizer, lambda q, turn: two_calls if turn == 0 else "Answer: ok")
    loop = make_loop(tokenizer, backend, tools={"recorder": tool})
    kwargs = {
        "recorder": {
            "create_kwargs": {"seed": 3},
            "execute_kwargs": {"mode": "fast"},
            "calc_reward_kwargs": {"bonus": 2.0},
            "release_kwargs": {"why": "done"},
        }
    }
    out = loop.generate_sequences(prompts(tokenizer, ["q"], tools_kwargs=kwargs))
    loop.shutdown()
    assert tool.peak == 2
    assert tool.events == [
        ("create", {"seed": 3}),
        ("execute", {"x": 1}, {"mode": "fast"}),
        ("execute", {"x": 2}, {"mode": "fast"}),
        ("calc_reward", {"bonus": 2.0}),
        ("release", {"why": "done"}),
    ]
    assert out.non_tensor_batch["reward_scores"][0] == {"recorder": 2.0}
    assert [m["content"] for m in out.non_tensor_batch["messages"][0] if m["role"] == "tool"] == [
        "recorded 1",
        "recorded 2",
    ]


def test_a_call_to_a_tool_the_sample_does_not_have_gets_an_error_response(tokenizer):
    backend = ScriptedBackend(
        tokenizer, lambda q, turn: '<tool_call>{"name": "search", "arguments": {}}</tool_call>' if turn == 0 else "ok"
    )
    loop = make_loop(tokenizer, backend)
    out = loop.generate_sequences(prompts(tokenizer, ["q"]))
    loop.shutdown()
    assert out.non_tensor_batch["messages"][0][2]["content"] == "Error: no tool named 'search' (available: calculator)"


@pytest.mark.loaded
def test_backend_timeout_fails_the_batch_without_hanging_and_cancels_the_rest(tokenizer):
    tool = Recorder()
    backend = ScriptedBackend(tokenizer, lambda q, turn: ScriptedBackend.HANG if q == "hang" else "Answer: 1")
    loop = make_loop(tokenizer, backend, tools={"recorder": tool}, timeout_s=0.3)
    batch = prompts(tokenizer, ["fine", "hang", "fine too"], tools_kwargs={"recorder": {}})
    with pytest.raises(RolloutError, match=r"request 1/0 \(turn 1\): backend did not answer within timeout_s=0.3"):
        loop.generate_sequences(batch)
    loop.shutdown()
    assert backend.cancelled == 1
    releases = [e for e in tool.events if e[0] == "release"]
    assert len(releases) == 3  # every request released its tools, failed or not


def test_backend_error_fails_the_request_and_names_it(tokenizer):
    backend = ScriptedBackend(tokenizer, lambda q, turn: RuntimeError("CUDA out of memory") if q == "b" else "ok")
    loop = make_loop(tokenizer, backend)
    with pytest.raises(
        RolloutError, match=r"request 1/0 \(turn 1\): backend error: RuntimeError\('CUDA out of memory'"
    ):
        loop.generate_sequences(prompts(tokenizer, ["a", "b"]))
    loop.shutdown()


def test_validation_uses_val_kwargs_and_one_sample(tokenizer):
    backend = ScriptedBackend(tokenizer, lambda q, turn: "Answer: 1")
    loop = make_loop(tokenizer, backend, n=4, temperature=1.0)
    out = loop.generate_sequences(prompts(tokenizer, ["a", "b"], validate=True))
    loop.shutdown()
    assert len(out) == 2
    assert {p.temperature for p in backend.params} == {0.0}
    assert out.meta_info["rollout"]["validate"] is True


def test_rollout_summary_in_meta_info(tokenizer):
    backend = ScriptedBackend(tokenizer, lambda q, turn: call("1 + 1") if turn == 0 else "Answer: 2")
    loop = make_loop(tokenizer, backend, n=2)
    out = loop.generate_sequences(prompts(tokenizer, ["a", "b"]))
    loop.shutdown()
    summary = out.meta_info["rollout"]
    assert summary["requests"] == 4 and summary["turns"] == 8 and summary["tool_calls"] == 4
    assert summary["generated_tokens"] == int(out.batch["response_mask"].sum())
    assert summary["finish_reasons"] == {"stop": 4}


def test_same_seed_same_sampling_seeds_and_steps_differ(tokenizer):
    def seeds(step):
        backend = ScriptedBackend(tokenizer, lambda q, turn: "Answer: 1")
        loop = make_loop(tokenizer, backend, n=2, seed=7)
        loop.generate_sequences(prompts(tokenizer, ["a", "b"], global_steps=step))
        loop.shutdown()
        return sorted(p.seed for p in backend.params)

    assert seeds(1) == seeds(1)
    assert seeds(1) != seeds(2)


# -- skip roles on the real entry points ----------------------------------------------------


def loop_config(tmp_path, n: int = 1, **section) -> dict:
    """A run config whose lengths and ``rollout.n`` are the loop's (``make_loop``): the skip role
    checks a cached rollout against them."""
    config = run_config(tmp_path, **section)
    config["data"].update(max_prompt_length=64, max_response_length=256)
    config["actor_rollout_ref"]["rollout"]["n"] = n
    return config


def test_rollout_role_second_run_loads_instead_of_generating(tokenizer, tmp_path):
    config = loop_config(tmp_path, n=2, steps=[1])
    batch = prompts(tokenizer, ["What is 2 + 2?", "What is 3 * 3?"], global_steps=1)
    results = []
    for _ in range(2):
        SkipManager.init(config)
        SkipManager.set_step(1)
        backend = ScriptedBackend(tokenizer, lambda q, turn: call("2 + 2") if turn == 0 else "Answer: 4")
        loop = make_loop(tokenizer, backend, n=2)
        results.append((loop.generate_sequences(batch), len(backend.params)))
        SkipManager.flush()
        loop.shutdown()
    (first, calls_first), (second, calls_second) = results
    assert calls_first == 8 and calls_second == 0
    assert first.equals(second)


def test_async_rollout_role_loads_each_sample_by_its_feed_index(tokenizer, tmp_path):
    config = loop_config(tmp_path, role="async_rollout", steps=[0, 1, 2])

    async def stream(loop):
        questions = [f"What is {i} + 1?" for i in range(3)]
        return await asyncio.gather(
            *(
                loop.generate_sequences_single(prompts(tokenizer, [q]), sample_id=f"sample_0_{i}")
                for i, q in enumerate(questions)
            )
        )

    outputs, calls = [], []
    for _ in range(2):
        SkipManager.init(config)
        backend = ScriptedBackend(tokenizer, lambda q, turn: f"Answer: {q}")
        loop = make_loop(tokenizer, backend)
        outputs.append(asyncio.run(stream(loop)))
        calls.append(len(backend.params))
        SkipManager.flush()
        loop.shutdown()
    assert calls == [3, 0]
    for a, b in zip(*outputs, strict=True):
        assert a.equals(b)
    assert [o.non_tensor_batch["messages"][0][-1]["content"] for o in outputs[1]] == [
        f"Answer: What is {i} + 1?" for i in range(3)
    ]
    assert all(o.batch["response_mask"].sum() > 0 for o in outputs[1])


@pytest.mark.loaded
def test_a_weight_update_with_interrupt_continues_requests_in_flight_with_the_new_weights(tokenizer, tiny_model_dir):
    """Partial rollout on the real hf engine: requests cut by the pause finish from their tokens
    so far, and each sample records the weight versions it was generated with."""
    from skip_core.backend import create_backend
    from skip_core.sections import Sections
    from skip_plugin_hf.options import HFOptions
    from transformers import AutoModelForCausalLM

    backend = create_backend("hf", Sections(HFOptions(device="cpu")), tiny_model_dir)
    loop = make_loop(tokenizer, backend, response_length=256, temperature=1.0, seed=0)
    new_weights = {
        k: v + 0.01 * torch.randn_like(v)
        for k, v in AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items()
    }
    # The engine's 5th forward pass waits until the update has paused the engine: the requests
    # of that wave are running when the pause lands, whatever the machine's load.
    pausing, reached = threading.Event(), threading.Event()
    pause = backend.pause

    async def observed_pause():
        pausing.set()  # the pause takes effect before the event loop sees the held pass end
        await pause()

    backend.pause = observed_pause
    passes = []

    def hold_the_fifth_pass(module, args, output):
        passes.append(1)
        if len(passes) == 5:
            reached.set()
            assert pausing.wait(120)

    backend.model.register_forward_hook(hold_the_fifth_pass)
    rolled = {}
    worker = threading.Thread(
        target=lambda: rolled.setdefault(
            "batch", loop.generate_sequences(prompts(tokenizer, ["What is 482 * 37?"] * 8))
        )
    )
    worker.start()
    assert reached.wait(120)
    loop.update_weights(new_weights, version=1, interrupt=True)
    worker.join(120)
    loop.shutdown()
    batch = rolled["batch"]
    cut = batch.non_tensor_batch["interruptions"] > 0
    assert cut.any()
    assert (batch.non_tensor_batch["min_weight_version"][cut] == 0).all()
    assert (batch.non_tensor_batch["max_weight_version"][cut] == 1).all()  # continued with the new weights
    assert "abort" not in set(batch.non_tensor_batch["finish_reason"])


def test_an_abort_nobody_asked_for_fails_the_request(tokenizer):
    class Aborting(ScriptedBackend):
        async def generate(self, prompt_ids, params, request_id):
            return [Generation([5, 6], [-0.1, -0.2], "abort")]

    loop = make_loop(tokenizer, Aborting(tokenizer, lambda q, turn: "x"))
    with pytest.raises(RolloutError, match="aborted by the backend"):
        loop.generate_sequences(prompts(tokenizer, ["What is 1 + 1?"]))
    loop.shutdown()
