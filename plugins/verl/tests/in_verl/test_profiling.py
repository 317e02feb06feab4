"""``skip.profiling`` in verl's own config: skip's spans from verl's real agent loop and trainer.

Everything here is verl 0.9.1's code as installed, patched only by skip-plugin-verl's import hook:
``AgentLoopWorker`` (in this process, and as Ray actors made by verl's ``AgentLoopManager``),
``AgentLoopWorkerTQ`` (the V1 worker), ``ToolAgentLoop``/``SingleTurnAgentLoop``,
``LLMServerClient``, a ``BaseTool`` loaded from a verl tool config, a tokenizer with a chat
template built in a temporary directory, and the V1 ``fit()`` loop of ``v1.py``. Scripted: the
LLM server and its load balancer (``ScriptedServer``, ``ScriptedBalancer``), the streaming
reward worker (``ScriptedReward``), and what ``v1.py`` scripts (actor, checkpoints).

The server answers ``question k`` with ``k % 3`` tool calls, one per turn, then ``Answer: k``:
a request of prompt ``k`` has ``k % 3 + 1`` turns, whatever runs it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
import v1
from omegaconf import open_dict
from skip_core import spans
from skip_core.config import ConfigError
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse
from verl.utils.skip import SkipManager
from verl.workers.rollout.replica import TokenOutput

HERE = Path(__file__).resolve().parent
needs_plugin = pytest.mark.skipif(
    importlib.util.find_spec("skip_plugin_profiling") is None, reason="skip-plugin-profiling is not installed here"
)
CHAT_TEMPLATE = (  # ChatML with hermes tool calls, as Qwen's
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}"
    "{%- for tool in tools %}{{- '\\n' ~ (tool | tojson) }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' ~ message.role ~ '\\n' }}"
    "{%- if message.role == 'tool' %}{{- '<tool_response>' ~ message.content ~ '</tool_response>' }}"
    "{%- else %}{{- message.content or '' }}{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '<tool_call>{\"name\": ' ~ (fn.name | tojson) ~ ', \"arguments\": ' }}"
    "{{- (fn.arguments if fn.arguments is string else (fn.arguments | tojson)) ~ '}</tool_call>' }}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS_YAML = """tools:
  - class_name: test_profiling.AddTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: add
        description: Add two integers.
        parameters: {type: object, properties: {a: {type: integer}, b: {type: integer}}, required: [a, b]}
"""


class AddTool(BaseTool):
    """A verl tool with the full lifecycle (create, execute, release), as verl's examples write them."""

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=str(int(parameters["a"]) + int(parameters["b"]))), 0.0, {}


class _Method:
    """``handle.method.remote(...)`` of a Ray actor handle, run in the caller's process."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class ScriptedServer:
    """Stands in for a vLLM server replica: ``generate`` returns token ids, as verl's server does.

    ``abort``: the first engine call of each request returns half its answer, ``aborted``, as a
    weight sync leaves a generation; the call resuming it gets the rest.
    """

    def __init__(self, model_dir: str, abort: bool = False) -> None:
        self.model_dir, self.abort, self.tokenizer = model_dir, abort, None
        self.generate = _Method(self._generate)

    def answer(self, prompt: str) -> str:
        k = int(re.search(r"question (\d+)", prompt).group(1))
        done = prompt.count("<tool_response>")
        if done < k % 3:
            return f'<tool_call>{{"name": "add", "arguments": {{"a": {k}, "b": {done}}}}}</tool_call><|im_end|>'
        return f"Answer: {k}<|im_end|>"

    async def _generate(self, *, request_id, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        prompt = self.tokenizer.decode(prompt_ids)
        text, reason = self.answer(prompt), "completed"
        half = text[: len(text) // 2]
        if self.abort and prompt.endswith(half):
            text = text[len(half) :]  # resumed
        elif self.abort and "<tool_response>" not in prompt:
            text, reason = half, "aborted"
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        await asyncio.sleep(0)
        # extra_fields: the weight version the server generated with, which the V1 trainer reads
        return TokenOutput(
            token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason=reason, extra_fields={"global_steps": 0}
        )


class ScriptedBalancer:
    """Stands in for verl's global load balancer actor: every request goes to the one server."""

    def __init__(self, server: ScriptedServer) -> None:
        self.require_acquire_fields = self.require_release_fields = _Method(self._fields)
        self.acquire_server = _Method(self._acquire)
        self.release_server = _Method(lambda **kwargs: None)
        self.server = server

    async def _fields(self):
        return []

    async def _acquire(self, request_id, **kwargs):
        return "server-0", self.server


class ScriptedReward:
    """Stands in for a reward loop worker actor: ``compute_score`` of one finished request."""

    def __init__(self) -> None:
        self.compute_score = _Method(self._score)

    async def _score(self, data):
        return {"reward_score": 1.0, "reward_extra_info": {"acc": 1.0}}


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A Hugging Face model directory with no weights: config.json and a byte-level BPE tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    target = tmp_path_factory.mktemp("tiny-model")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["question Answer: add name arguments user assistant system tool"], trainer)
    tags = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in tags])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(target)
    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    LlamaConfig(vocab_size=len(fast), architectures=["LlamaForCausalLM"], **shape).save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def ray_tq():
    """One Ray and TransferQueue per session (``v1.start_transfer_queue``). The Ray workers load
    this module (the scripted server, the tool): a Ray started here passes them this directory."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), before]))
    try:
        v1.start_transfer_queue()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


@pytest.fixture(autouse=True)
def _no_sinks_left():
    yield
    spans.close()  # this process's sinks: the next test configures its own


def verl_config(tmp_path: Path, model_dir: Path, profile: Path | None, agent: str = "tool_agent", **settings):
    """verl's ``ppo_trainer.yaml`` (``v1.verl_config``) for the agent loop, with ``skip.profiling``."""
    config = v1.verl_config(tmp_path / "dumps")
    tools = tmp_path / "tools.yaml"
    tools.write_text(TOOLS_YAML)
    with open_dict(config):
        config.skip.rollout_tq.enable = False
        config.actor_rollout_ref.model.path = str(model_dir)
        config.data.max_prompt_length, config.data.max_response_length = 256, 160
        rollout = config.actor_rollout_ref.rollout
        rollout.name = "vllm"
        rollout.multi_turn.tool_config_path = str(tools)
        rollout.agent.default_agent_loop = agent
        rollout.agent.num_workers = 2
        if profile is not None:
            config.skip.profiling = {"enable": True, "dir": str(profile), "flush_interval_s": 0.05, **settings}
    return config


def client(config, model_dir: Path):
    from verl.workers.rollout.llm_server import LLMServerClient

    return LLMServerClient(config, load_balancer_handle=ScriptedBalancer(ScriptedServer(str(model_dir))))


def prompt_batch(ks, n: int, step: int, validate: bool = False, agents=None):
    """A generation batch as RayPPOTrainer hands it to the agent loop: ``n`` copies of each prompt in a row."""
    from verl.protocol import DataProto

    chats = np.empty(len(ks), dtype=object)
    for i, k in enumerate(ks):
        chats[i] = [{"role": "user", "content": f"question {k}"}]
    non_tensors = {"raw_prompt": chats, "index": np.array(ks), "uid": np.array([f"uid-{k}" for k in ks], dtype=object)}
    if agents is not None:
        non_tensors["agent_name"] = np.array(agents, dtype=object)
    batch = DataProto.from_dict(non_tensors=non_tensors, meta_info={"global_steps": step, "validate": validate})
    return batch.repeat(repeat_times=n, interleave=True)


def read_spans(directory: Path) -> list[dict]:
    """Every span under ``directory``, with the file it is in (``step_1/worker_0.jsonl``)."""
    rows = []
    for path in sorted(directory.rglob("*.jsonl")):
        name = str(path.relative_to(directory))
        rows += [json.loads(line) | {"file": name} for line in path.read_text().splitlines()]
    return rows


def events(rows: list[dict], name: str) -> list[dict]:
    return [row for row in rows if row["event"] == name]


def children(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Spans by their parent, ``(pid, span_id)``: span ids are unique within a process."""
    found = defaultdict(list)
    for row in rows:
        found[(row["pid"], row["parent_id"])].append(row)
    for kids in found.values():
        kids.sort(key=lambda row: row["start"])
    return found


def kids_of(tree: dict, span: dict) -> list[dict]:
    return tree[(span["pid"], span["span_id"])]


def check_request(tree: dict, request: dict, k: int) -> None:
    """A request of prompt ``k``, nested as verl ran it: preprocess, then ``k % 3 + 1`` turns of
    one engine call each and a tool call in each but the last, then its reward."""
    extra, kids = request["extra"], kids_of(tree, request)
    assert [kid["event"] for kid in kids] == ["preprocess", *["turn"] * (k % 3 + 1), "reward"], extra
    turns = [kid for kid in kids if kid["event"] == "turn"]
    assert [turn["extra"]["turn"] for turn in turns] == list(range(1, k % 3 + 2))
    generated = []
    for turn in turns:
        inside = kids_of(tree, turn)
        assert [kid["event"] for kid in inside] == ["generate"] + ([] if turn is turns[-1] else ["tool_call"])
        for kid in inside:  # the request's context reaches its leaves
            assert (kid["extra"]["request_id"], kid["extra"]["offset"]) == (extra["request_id"], extra["offset"])
            assert (kid["extra"]["turn"], kid["workid"], kid["step"]) == (
                turn["extra"]["turn"],
                request["workid"],
                request["step"],
            )
        assert all(kid["extra"]["tool"] == "add" for kid in inside if kid["event"] == "tool_call")
        generated.append(inside[0]["extra"])
    assert all(g["finish_reason"] == "completed" and g["tokens_out"] > 0 for g in generated)
    assert generated[0]["tokens_in"] == kids[0]["extra"]["prompt_tokens"] == extra["prompt_tokens"]
    assert [g["tokens_in"] for g in generated] == sorted({g["tokens_in"] for g in generated})  # the context grows
    assert (extra["turns"], extra["tool_calls"], extra["finish_reason"]) == (k % 3 + 1, k % 3, "completed")
    assert extra["response_tokens"] == sum(g["tokens_out"] for g in generated)
    assert kids[-1]["extra"]["score"] == 1.0


# -- the key -------------------------------------------------------------------------------


@needs_plugin
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("flush_interval_s", 0, r"skip\.profiling\.flush_interval_s: "),
        ("steps", [1, "x"], r"skip\.profiling\.steps\[1\]: "),
        ("dirr", "x", r"skip\.profiling\.dirr: unknown key .*did you mean skip\.profiling\.dir\?"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key_before_anything_is_written(tmp_path, key, value, message):
    from conftest import run_config

    config = run_config(tmp_path / "dumps")
    config.skip.profiling = {"enable": True, "dir": str(tmp_path / "profile"), key: value}

    with pytest.raises(ConfigError, match=message) as raised:
        SkipManager.init(config)
    assert "\n" not in str(raised.value)
    assert not list(tmp_path.iterdir())  # no store opened, no log directory made
    assert not spans.enabled()


@needs_plugin
def test_the_trainer_process_records_as_worker_minus_one_beside_skip_roles(tmp_path, rollout_manager, worker):
    """``skip.profiling`` is no role: the roles of the same section are served as before. The
    trainer's ``marked_timer`` phases are spans of the step, and the skip roles' cache spans nest
    in the phase that called them."""
    from verl.trainer.ppo.v1 import trainer_base  # what verl's V1 trainer times its phases with

    from conftest import prompts, run_config

    config = run_config(tmp_path / "dumps")
    config.skip.profiling = {"enable": True, "dir": str(tmp_path / "profile")}
    SkipManager.init(config)
    SkipManager.set_step(1)
    timing = {}
    for _ in range(2):  # the second generation is replayed from skip's cache
        with trainer_base.marked_timer("gen", timing):
            rollout_manager.generate_sequences(prompts())
    spans.close()

    rows = read_spans(tmp_path / "profile")
    assert {(row["file"], row["step"], row["workid"]) for row in rows} == {("step_1/worker_-1.jsonl", 1, -1)}
    phases = events(rows, "trainer/gen")
    assert len(phases) == 2 and timing["gen"] > 0
    tree = children(rows)
    assert [[kid["event"] for kid in kids_of(tree, phase)] for phase in phases] == [
        ["skip_lookup", "skip_dump"],
        ["skip_lookup", "skip_load"],
    ]
    assert [row["extra"]["cache"] for row in events(rows, "skip_lookup")] == ["miss", "hit"]
    assert len(worker.batches) == 1


def test_without_the_profiling_plugin_the_key_warns_once_naming_pip_install(tmp_path):
    """``SKIP_PLUGINS`` leaving skip-plugin-profiling out is the plugin not installed; the run goes on."""
    script = f"""
import json, sys, warnings
sys.path.insert(0, {str(HERE)!r})
from verl.utils.skip import SkipManager
from skip_core import spans
from conftest import run_config
config = run_config(__import__("pathlib").Path({str(tmp_path / "dumps")!r}))
config.skip.profiling = {{"enable": True, "dir": {str(tmp_path / "profile")!r}, "flush_interval_s": "bad"}}
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    SkipManager.init(config)
    SkipManager.init(config)
print(json.dumps({{"said": [str(w.message) for w in said], "served_by": SkipManager.served_by,
                   "enabled": spans.enabled(), "stores": sorted(__import__("skip_core").SkipManager.stores())}}))
"""
    environment = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    environment["SKIP_PLUGINS"] = "skip-plugin-verl,skip-plugin-rollout"
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    [warning] = [message for message in report["said"] if "profiling" in message]
    assert "skip.profiling.enable is true but skip-plugin-profiling is not installed" in warning
    assert "pip install skip-plugin-profiling" in warning
    assert report["served_by"] == "skip-plugin-verl" and report["stores"] == ["rollout"]
    assert not report["enabled"] and not (tmp_path / "profile").exists()


# -- the agent loop --------------------------------------------------------------------------


@needs_plugin
def test_an_agent_loop_worker_records_each_request_turn_and_event_under_its_step(tmp_path, model_dir):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    profile = tmp_path / "profile"
    config = verl_config(tmp_path, model_dir, profile)
    worker = AgentLoopWorker(config, client(config, model_dir), None, [ScriptedReward()])
    ks = list(range(6))  # 1, 2 or 3 turns; the 1-turn prompts through verl's single-turn loop
    agents = ["single_turn_agent" if k % 3 == 0 else "tool_agent" for k in ks]
    train = asyncio.run(worker.generate_sequences(prompt_batch(ks, n=2, step=3, agents=agents)))
    asyncio.run(worker.generate_sequences(prompt_batch(ks, n=1, step=3, validate=True, agents=agents)))
    spans.close()

    rows = read_spans(profile)
    [rank] = {row["workid"] for row in rows}
    assert {row["file"] for row in rows} == {f"step_3/worker_{rank}.jsonl", f"val_step_3/worker_{rank}.jsonl"}
    tree = children(rows)
    for phase, n, folder in (("train", 2, "step_3"), ("val", 1, "val_step_3")):
        mine = [row for row in rows if row["file"].startswith(folder + "/")]
        assert {(row["phase"], row["step"], row["pid"]) for row in mine} == {(phase, 3, os.getpid())}
        [rollout] = events(mine, "rollout")
        assert rollout["parent_id"] == 0 and rollout["extra"] == {"requests": 6 * n, "validate": phase == "val"}
        assert [kid["event"] for kid in kids_of(tree, rollout)] == ["request"] * 6 * n + ["padding"]
        requests = events(mine, "request")
        assert len({request["extra"]["request_id"] for request in requests}) == 6 * n
        sessions = Counter((request["extra"]["uid"], request["extra"]["offset"]) for request in requests)
        assert sessions == {(f"uid-{k}", offset): 1 for k in ks for offset in range(n)}
        for request in requests:
            k = int(request["extra"]["uid"].removeprefix("uid-"))
            assert request["extra"]["agent"] == agents[k] and request["extra"]["prompt"] == k
            check_request(tree, request, k)
    assert list(train.non_tensor_batch["__num_turns__"]) == [2 * (k % 3) + 2 for k in ks for _ in range(2)]


def test_without_the_key_verl_runs_as_it_does_with_it_and_nothing_is_written(tmp_path, model_dir):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    outputs = []
    for profile in (None, tmp_path / "profile"):
        if profile is not None and importlib.util.find_spec("skip_plugin_profiling") is None:
            break
        config = verl_config(tmp_path, model_dir, profile)
        worker = AgentLoopWorker(config, client(config, model_dir), None, [ScriptedReward()])
        assert spans.enabled() is (profile is not None)
        outputs.append(asyncio.run(worker.generate_sequences(prompt_batch(range(6), n=2, step=1))))
    assert not (tmp_path / "profile").exists() or len(outputs) == 2
    for later in outputs[1:]:
        keys = set(outputs[0].batch.keys())
        assert set(later.batch.keys()) == keys
        for key in keys:
            assert (later.batch[key] == outputs[0].batch[key]).all(), key
        assert list(later.non_tensor_batch["__num_turns__"]) == list(outputs[0].non_tensor_batch["__num_turns__"])


@needs_plugin
def test_engine_calls_resuming_an_aborted_generation_are_one_turn(tmp_path, model_dir):
    """verl's async V1 trainers give the agent loop a ``FullyAsyncLLMServerClient``: a generation a
    weight sync aborted is resumed with another engine call, a ``generate`` of the same turn."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    profile = tmp_path / "profile"
    config = verl_config(tmp_path, model_dir, profile)
    balancer = ScriptedBalancer(ScriptedServer(str(model_dir), abort=True))
    worker = AgentLoopWorker(config, FullyAsyncLLMServerClient(config, balancer), None, [ScriptedReward()])
    ks = list(range(6))
    agents = ["single_turn_agent" if k % 3 == 0 else "tool_agent" for k in ks]
    output = asyncio.run(worker.generate_sequences(prompt_batch(ks, n=1, step=5, agents=agents)))
    spans.close()

    rows = read_spans(profile)
    tree = children(rows)
    assert len(events(rows, "request")) == 6
    for request in events(rows, "request"):
        k, extra = request["extra"]["prompt"], request["extra"]
        turns = [kid for kid in kids_of(tree, request) if kid["event"] == "turn"]
        assert [turn["extra"]["turn"] for turn in turns] == list(range(1, k % 3 + 2))
        calls = [[kid for kid in kids_of(tree, turn) if kid["event"] == "generate"] for turn in turns]
        assert [[call["extra"]["finish_reason"] for call in turn] for turn in calls] == [
            ["aborted", "completed"],
            *[["completed"]] * (k % 3),
        ]
        assert (
            calls[0][1]["extra"]["tokens_in"] == calls[0][0]["extra"]["tokens_in"] + calls[0][0]["extra"]["tokens_out"]
        )
        assert extra["response_tokens"] == sum(call["extra"]["tokens_out"] for turn in calls for call in turn)
        assert (extra["turns"], extra["tool_calls"], extra["finish_reason"]) == (k % 3 + 1, k % 3, "completed")
    assert list(output.non_tensor_batch["__num_turns__"]) == [2 * (k % 3) + 2 for k in ks]


@needs_plugin
def test_a_sink_that_cannot_write_warns_once_and_the_rollout_goes_on(tmp_path, model_dir):
    from skip_plugin_profiling.recorder import ProfilingWarning
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    (tmp_path / "a-file").write_text("")
    config = verl_config(tmp_path, model_dir, tmp_path / "a-file" / "profile", flush_interval_s=3600)
    worker = AgentLoopWorker(config, client(config, model_dir), None, [ScriptedReward()])
    with pytest.warns(ProfilingWarning, match="profiling stops, training goes on") as said:
        outputs = [asyncio.run(worker.generate_sequences(prompt_batch(range(6), n=2, step=k))) for k in (1, 2)]
    assert len([w for w in said if issubclass(w.category, ProfilingWarning)]) == 1
    for output in outputs:
        assert list(output.non_tensor_batch["__num_turns__"]) == [2 * (k % 3) + 2 for k in range(6) for _ in range(2)]


def test_a_verl_method_not_as_expected_is_left_as_verl_wrote_it_with_one_warning():
    """What ``install`` does to each class it instruments, here to one verl could become: a
    method that is no longer a coroutine function, one that is gone. All of the class's
    methods stay verl's, and it is said once."""
    from skip_plugin_verl import patching, profiling

    class ToolAgentLoop:
        async def _handle_generating_state(self, agent_data):
            return "generated"

        def _handle_processing_tools_state(self, agent_data):  # a coroutine function in verl 0.9.1
            return "processed"

    module = types.ModuleType("verl_to_come")
    module.ToolAgentLoop = ToolAgentLoop
    before = dict(vars(ToolAgentLoop))
    hooks = {"_handle_generating_state": profiling._turn_start, "_handle_processing_tools_state": profiling._turn_end}
    with pytest.warns(profiling.VerlProfilingWarning) as said:
        assert not patching.patch(module, "ToolAgentLoop", hooks)
        assert not patching.patch(module, "ToolAgentLoop", hooks)
        assert not patching.patch(module, "Gone", {"_call_tool": profiling._tool_call})
    assert dict(vars(ToolAgentLoop)) == before
    assert [str(w.message) for w in said] == [
        "skip-plugin-profiling: verl's verl_to_come.ToolAgentLoop._handle_processing_tools_state is not what "
        "skip instruments; verl_to_come.ToolAgentLoop is left as verl wrote it; its spans are missing",
        "skip-plugin-profiling: verl's verl_to_come.Gone._call_tool is not what skip instruments; "
        "verl_to_come.Gone is left as verl wrote it; its spans are missing",
    ]


@needs_plugin
def test_verls_manager_starts_ray_workers_that_record_under_their_rank(tmp_path, model_dir, ray_tq):
    """verl's ``AgentLoopManager`` makes the workers Ray actors: the bridge patched verl in their
    processes as it loaded, and each writes its own file under the rank in its actor name."""
    import ray
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager

    profile = tmp_path / "profile"
    config = verl_config(tmp_path, model_dir, profile)
    manager = AgentLoopManager.create(config, client(config, model_dir), None, [ScriptedReward()])
    try:
        manager.generate_sequences(prompt_batch(list(range(8)), n=2, step=2))
    finally:
        for actor in manager.agent_loop_workers:
            ray.kill(actor)

    rows = read_spans(profile)
    assert {row["file"] for row in rows} == {"step_2/worker_0.jsonl", "step_2/worker_1.jsonl"}
    pids = set()
    for rank in (0, 1):
        mine = [row for row in rows if row["file"] == f"step_2/worker_{rank}.jsonl"]
        assert {row["workid"] for row in mine} == {rank}
        [pid] = {row["pid"] for row in mine}
        pids.add(pid)
        [rollout] = events(mine, "rollout")
        assert rollout["extra"]["requests"] == len(events(mine, "request")) == 8  # verl splits 16 rows in two
    assert len(pids) == 2 and os.getpid() not in pids
    tree = children(rows)
    for request in events(rows, "request"):
        check_request(tree, request, int(request["extra"]["uid"].removeprefix("uid-")))


def v1_prompts(ks, step: int):
    """A prompt batch as the V1 trainer submits it (``_next_train_batch``): a TensorDict."""
    from verl.utils import tensordict_utils as tu

    chats = np.empty(len(ks), dtype=object)
    for i, k in enumerate(ks):
        chats[i] = [{"role": "user", "content": f"question {k}"}]
    fields = {"raw_prompt": chats, "index": np.array(ks), "uid": np.array([f"uid-{k}" for k in ks], dtype=object)}
    batch = tu.get_tensordict(fields)
    tu.assign_non_tensor_data(batch, "global_steps", step)
    return batch


@needs_plugin
def test_the_v1_transfer_queue_worker_records_each_session_of_each_prompt(tmp_path, model_dir, ray_tq):
    """``AgentLoopWorkerTQ`` (a ``@ray.remote`` class, driven here through Ray's class) starts its
    requests in the background with no batch span: each request carries step, worker and session."""
    import transfer_queue as tq
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    profile = tmp_path / "profile"
    config = verl_config(tmp_path, model_dir, profile)
    worker = AgentLoopWorkerTQ.__ray_metadata__.modified_class(
        config, client(config, model_dir), None, [ScriptedReward()]
    )
    ks = [1, 2, 4, 5]

    async def generate() -> None:
        await worker.generate_sequences(v1_prompts(ks, step=4))
        await asyncio.gather(*list(worker.background_tasks))  # the requests verl left running

    asyncio.run(generate())
    spans.flush()
    try:
        written = set(tq.kv_list(v1.PARTITION).get(v1.PARTITION, {}))
        assert {f"uid-{k}_{session}_0" for k in ks for session in (0, 1)} <= written
    finally:
        for key in written:
            tq.kv_clear(keys=[key], partition_id=v1.PARTITION)

    rows = read_spans(profile)
    [rank] = {row["workid"] for row in rows}
    assert {row["file"] for row in rows} == {f"step_4/worker_{rank}.jsonl"}
    assert not events(rows, "rollout")
    requests = events(rows, "request")
    assert all(request["parent_id"] == 0 and request["step"] == 4 for request in requests)
    sessions = Counter((request["extra"]["uid"], request["extra"]["offset"]) for request in requests)
    assert sessions == {(f"uid-{k}", session): 1 for k in ks for session in (0, 1)}
    tree = children(rows)
    for request in requests:
        check_request(tree, request, int(request["extra"]["uid"].removeprefix("uid-")))


# -- the trainer, and the report ------------------------------------------------------------


@needs_plugin
def test_a_v1_run_records_both_sides_and_skip_profile_report_reads_them(tmp_path, model_dir, ray_tq):
    """verl's V1 ``fit()`` (``v1.py``) with verl's ``AgentLoopManagerTQ`` and its Ray workers in
    place of the harness's scripted agent loop: one run, one key, the trainer's phases and the
    agent loop's requests under the same steps, and ``skip profile report`` over them."""
    import ray
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

    profile = tmp_path / "profile"
    config = verl_config(tmp_path, model_dir, profile)  # 3 steps of 4 prompts, 2 sessions each
    data = []
    for start in (0, 4, 8):
        chats = np.empty(4, dtype=object)
        for i in range(4):
            chats[i] = [{"role": "user", "content": f"question {start + i}"}]
        data.append({"raw_prompt": chats, "index": np.arange(start, start + 4), "data_source": np.array(["x"] * 4)})
    manager = AgentLoopManagerTQ.create(config, client(config, model_dir), None, [ScriptedReward()])
    try:
        run = v1.fit(config, data, agent_loop=manager)
    finally:
        for actor in manager.agent_loop_workers:
            ray.kill(actor)
    spans.close()
    assert [metrics["training/global_step"] for metrics in run.metrics] == [1, 2, 3]

    rows = read_spans(profile)
    assert {row["file"] for row in rows} == {f"step_{k}/worker_{r}.jsonl" for k in (1, 2, 3) for r in (-1, 0, 1)}
    assert all(row["step"] == int(row["file"][5]) and row["workid"] == int(row["file"][14:-6]) for row in rows)
    tree = children(rows)
    for k in (1, 2, 3):
        trainer = [row for row in rows if row["file"] == f"step_{k}/worker_-1.jsonl"]
        [step] = events(trainer, "trainer/step")
        assert step["parent_id"] == 0 and len(trainer) == 1 + len(kids_of(tree, step))
        phases = [
            "trainer/gen",
            "trainer/old_log_prob",
            "trainer/adv",
            "trainer/update_actor",
            "trainer/update_weights",
        ]
        assert [kid["event"] for kid in kids_of(tree, step)] == phases
        requests = [row for row in events(rows, "request") if row["step"] == k]
        assert Counter(request["workid"] for request in requests) == {0: 4, 1: 4}  # verl splits 4 prompts in two
        assert sorted(request["extra"]["prompt"] for request in requests) == sorted(2 * list(range(4 * k - 4, 4 * k)))
        for uid in {request["extra"]["uid"] for request in requests}:
            assert sorted(r["extra"]["offset"] for r in requests if r["extra"]["uid"] == uid) == [0, 1]
        for request in requests:
            check_request(tree, request, request["extra"]["prompt"])

    done = subprocess.run(
        [sys.executable, "-m", "skip_core", "profile", "report", str(profile)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (profile / "report" / "index.html").is_file()
    markdown = (profile / "report" / "report.md").read_text()
    # prompts k = 0..11: k % 3 + 1 turns, 4 prompts of each, 2 sessions of each prompt
    by_turns = table(markdown, "Mean request time by number of turns")
    assert [(row["turns"], row["requests"]) for row in by_turns] == [("1", "8"), ("2", "8"), ("3", "8")]
    assert "requests with 1 turn (n=8), 2 turns (n=8), 3 turns (n=8)" in done.stdout
    phases = table(markdown, "Per step", after="## Trainer phases")
    assert [row["step"] for row in phases] == ["1", "2", "3"]
    assert list(phases[0]) == ["step", "total", "gen", "old_log_prob", "adv", "update_actor", "update_weights", "other"]
    shares = table(markdown, "Avg % of total time")
    assert {row["event"] for row in shares} == {"preprocess", "generate", "tool_call", "reward", "other/idle"}


def table(markdown: str, caption: str, after: str = "") -> list[dict[str, str]]:
    """The rows of the report.md table captioned ``*caption*`` (the first after ``after``)."""
    lines = markdown[markdown.index(after) :].splitlines()
    start = lines.index(f"*{caption}*") + 2
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True)))
    return rows
