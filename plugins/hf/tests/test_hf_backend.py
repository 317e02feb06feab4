"""The hf rollout backend, run on a tiny random Llama saved to disk (no mocks of our own code)."""

from __future__ import annotations

import asyncio
import re
import threading
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from skip_core.backend import Generation, SamplingParams, create_backend, one_bucket
from skip_core.config import ConfigError
from skip_core.plugins import registry
from skip_core.sections import Sections, parse_sections
from skip_plugin_arithmetic.tiny_model import llama
from skip_plugin_hf.engine import HFBackend
from skip_plugin_hf.options import HFOptions
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

MAX_POSITIONS = 256
EOS = 2
TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "pack my box with five dozen liquor jugs",
    "sphinx of black quartz, judge my vow",
    "how vexingly quick daft zebras jump",
    "answer: 42 + 17 = 59",
]


def save_tiny_llama(directory: Path, seed: int) -> Path:
    special = {"eos_token_id": EOS, "pad_token_id": 0, "bos_token_id": 1}
    llama(300, seed, max_position_embeddings=MAX_POSITIONS, **special).save_pretrained(directory)
    save_byte_level_tokenizer(directory)
    return directory


def save_byte_level_tokenizer(directory: Path) -> None:
    """A 300-token byte-level BPE, so every id the model can sample decodes to at least one byte."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXT * 3, trainer)
    assert tokenizer.get_vocab_size() == 300
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(directory)


@pytest.fixture(scope="session")
def tiny_hf_model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def other_hf_model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("other-llama"), seed=1)


def make_backend(model_dir: Path, **hf) -> HFBackend:
    return create_backend("hf", Sections(HFOptions(device="cpu", **hf)), model_dir)


def generate(backend: HFBackend, prompt: list[int], **params) -> list[Generation]:
    return asyncio.run(backend.generate(prompt, SamplingParams(**params), "r"))


def prompts(count: int) -> list[list[int]]:
    """Prompts of different lengths, so batches are left-padded."""
    return [[1, *range(3 + i, 3 + i + 2 + i % 7)] for i in range(count)]


def record_batches(backend: HFBackend) -> list[tuple[int, int]]:
    """(rows, columns) of input_ids at every forward pass: columns > 1 is a prefill."""
    seen: list[tuple[int, int]] = []

    def hook(module, args, kwargs):
        seen.append(tuple(kwargs["input_ids"].shape))

    backend.model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


class HeldPass:
    """The engine's ``k``-th forward pass, held on its worker thread until ``release()``.

    While it is held the engine can take no further step: its wave is running, its rows have
    ``k - 1`` tokens, and nothing the test does meanwhile (cancel, submit, pause, shut down)
    races with the engine, however loaded the machine. After ``release()`` the engine sees the
    pass end only on a later turn of the event loop, so an action called right after it, with
    no ``await`` between, starts before the engine takes its ``k``-th token: a pause or a
    shutdown (which set their flag before they first wait) then stops the wave exactly there.
    """

    def __init__(self, backend: HFBackend, k: int):
        self.k = k
        self.passes = 0
        self._reached, self._released = threading.Event(), threading.Event()
        backend.model.register_forward_hook(self._hold)

    def _hold(self, module, args, output) -> None:
        self.passes += 1
        if self.passes == self.k:
            self._reached.set()
            self._released.wait()

    async def reached(self, request: asyncio.Task) -> None:
        """Until the engine is inside the held pass; fails, not hangs, if ``request`` ends first."""
        await until(lambda: self._reached.is_set() or request.done())
        assert self._reached.is_set(), f"the request ended before forward pass {self.k}"

    def release(self) -> None:
        self._released.set()


@pytest.fixture
def hold_pass():
    """``hold_pass(backend, k)`` holds that backend's ``k``-th forward pass (``HeldPass``).

    Every hold is released when the test ends, passed or failed: a worker thread left
    waiting in the hook would keep the interpreter from exiting.
    """
    made: list[HeldPass] = []

    def hold(backend: HFBackend, k: int) -> HeldPass:
        made.append(HeldPass(backend, k))
        return made[-1]

    yield hold
    for held in made:
        held.release()


def direct_log_probs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def greedy_by_argmax(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


# -- what one request gets -----------------------------------------------------------------


def test_generation_stops_at_max_new_tokens_with_length(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    [out] = generate(backend, [1, 5, 6, 7], max_new_tokens=12, temperature=0)
    assert out.finish_reason == "length"
    assert len(out.token_ids) == len(out.log_probs) == 12
    assert all(isinstance(lp, float) for lp in out.log_probs)


def test_temperature_zero_follows_the_model_argmax(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    [out] = generate(backend, [1, 9, 8, 7, 6], max_new_tokens=10, temperature=0)
    assert out.token_ids == greedy_by_argmax(backend.model, [1, 9, 8, 7, 6], 10)


def test_top_k_one_samples_the_greedy_tokens(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    [greedy] = generate(backend, [1, 4, 4, 4], max_new_tokens=10, temperature=0)
    [top_one] = generate(backend, [1, 4, 4, 4], max_new_tokens=10, temperature=1.3, top_k=1)
    assert top_one.token_ids == greedy.token_ids


def test_a_stop_token_ends_the_completion_and_is_kept(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    [free] = generate(backend, [1, 20, 21], max_new_tokens=10, seed=3)
    cut = next(i for i in range(1, 10) if free.token_ids[i] not in free.token_ids[:i])
    [out] = generate(backend, [1, 20, 21], max_new_tokens=10, seed=3, stop_token_ids=[free.token_ids[cut]])
    assert out.token_ids == free.token_ids[: cut + 1]
    assert out.finish_reason == "stop"


def test_the_models_eos_token_stops_generation(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    always_eos = torch.zeros(300).index_fill(0, torch.tensor([EOS]), 1e4)
    backend.model.lm_head.bias = torch.nn.Parameter(always_eos, requires_grad=False)
    [out] = generate(backend, [1, 5], max_new_tokens=10, seed=0)
    assert out.token_ids == [EOS]
    assert out.finish_reason == "stop"


def test_a_stop_string_ends_the_completion_at_the_token_completing_it(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    tokenizer = backend.tokenizer
    [free] = generate(backend, [1, 30, 31], max_new_tokens=60, seed=11)
    text = tokenizer.decode(free.token_ids)
    # A stop string late in the completion, so the backend's decode window is exercised.
    start = next(
        i
        for i in range(len(text) * 2 // 3, len(text) - 3)
        if text[i : i + 3].isascii() and text[i : i + 3].isprintable()
    )
    stop = text[start : start + 3]
    cut = next(i for i in range(60) if stop in tokenizer.decode(free.token_ids[: i + 1]))
    [out] = generate(backend, [1, 30, 31], max_new_tokens=60, seed=11, stop=[stop])
    assert out.token_ids == free.token_ids[: cut + 1]
    assert out.finish_reason == "stop"


def test_config_overrides_change_the_model_the_engine_runs(tiny_hf_model_dir):
    """verl's model.override_config, as this engine takes it: the config's entries replaced."""
    plain, eps = make_backend(tiny_hf_model_dir), 0.5
    overridden = make_backend(tiny_hf_model_dir, config_overrides={"rms_norm_eps": eps})
    assert overridden.model.config.rms_norm_eps == eps != plain.model.config.rms_norm_eps
    [a], [b] = (generate(backend, [1, 5, 6, 7], max_new_tokens=1, temperature=1.0) for backend in (plain, overridden))
    assert a.log_probs != b.log_probs


def test_log_probs_match_a_direct_forward_pass_before_filtering(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    prompt = [1, 11, 12, 13, 14]
    [sampled] = generate(backend, prompt, max_new_tokens=16, temperature=0.7, top_k=20, top_p=0.9, seed=5)
    [greedy] = generate(backend, prompt, max_new_tokens=16, temperature=0)
    expected = direct_log_probs(backend.model, prompt, sampled.token_ids, 0.7)
    assert torch.allclose(torch.tensor(sampled.log_probs), expected, atol=1e-4)
    # Greedy reports log-probs at temperature 1.
    expected = direct_log_probs(backend.model, prompt, greedy.token_ids, 1.0)
    assert torch.allclose(torch.tensor(greedy.log_probs), expected, atol=1e-4)


def test_n_samples_each_follow_their_own_seeded_stream(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    first = generate(backend, [1, 40, 41], max_new_tokens=8, seed=9, n=4)
    again = generate(backend, [1, 40, 41], max_new_tokens=8, seed=9, n=4)
    assert len(first) == 4
    assert len({tuple(g.token_ids) for g in first}) == 4
    assert [g.token_ids for g in again] == [g.token_ids for g in first]


def test_generation_never_runs_past_the_models_positions(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    [out] = generate(backend, [1] + [7] * (MAX_POSITIONS - 7), max_new_tokens=20, temperature=0)
    assert len(out.token_ids) == 6
    assert out.finish_reason == "length"
    with pytest.raises(ValueError, match="256 positions"):
        generate(backend, [7] * MAX_POSITIONS, max_new_tokens=1)


# -- batching ------------------------------------------------------------------------------


def test_concurrent_requests_are_prefilled_in_one_batch(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    seen = record_batches(backend)

    async def main():
        params = SamplingParams(max_new_tokens=6, seed=0)
        return await asyncio.gather(*(backend.generate(p, params, f"r{i}") for i, p in enumerate(prompts(16))))

    outs = asyncio.run(main())
    assert seen[0] == (16, max(map(len, prompts(16))))
    assert all(rows <= 16 for rows, _ in seen)
    assert backend.stats.rows_per_prefill == [16]
    assert [len(out) for out in outs] == [1] * 16


def test_counters_count_the_forward_passes_the_model_ran(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    assert backend.counters() == {name: 0 for name in backend.counters()}
    seen = record_batches(backend)

    async def main():
        params = SamplingParams(max_new_tokens=6, seed=0)
        return await asyncio.gather(*(backend.generate(p, params, f"r{i}") for i, p in enumerate(prompts(5))))

    outs = asyncio.run(main())
    counts = backend.counters()
    decodes = [rows for rows, columns in seen if columns == 1]  # every prompt here is longer than one token
    assert counts["forward_passes"] == len(seen) and counts["decode_passes"] == len(decodes)
    assert counts["decode_rows"] == sum(decodes)
    assert counts["tokens"] == sum(len(out[0].token_ids) for out in outs)
    assert counts["forward_s"] > 0


@pytest.mark.loaded
def test_requests_arriving_during_a_pass_are_prefilled_together_and_join_the_batch(tiny_hf_model_dir, hold_pass):
    backend = make_backend(tiny_hf_model_dir)
    seen = record_batches(backend)
    held = hold_pass(backend, 1)  # the first request's prefill: the late requests arrive while it runs

    async def main():
        long = asyncio.create_task(backend.generate([1, 5], SamplingParams(max_new_tokens=8, temperature=0), "long"))
        await held.reached(long)
        params = SamplingParams(max_new_tokens=4, temperature=0)
        late = [asyncio.create_task(backend.generate(p, params, "late")) for p in prompts(3)]
        await asyncio.sleep(0)  # one turn: all three are queued
        held.release()
        return await asyncio.gather(long, *late)

    asyncio.run(main())
    prefills = [shape for shape in seen if shape[1] > 1]
    assert prefills == [(1, 2), (3, max(map(len, prompts(3))))]
    # One decode pass of the first request comes between (a prefill is followed by a decode pass
    # whatever arrived during it, so a stream of arrivals never starves the batch), then all four.
    assert seen[:4] == [(1, 2), (1, 1), (3, max(map(len, prompts(3)))), (4, 1)]
    assert backend.stats.rows_per_prefill == [1, 3]


# -- continuous batching -------------------------------------------------------------------


def submit_during_a_long_request(backend: HFBackend, hold_pass, short_params: SamplingParams):
    """A 40-token greedy request, and a 4-token one submitted while the long one's 3rd pass runs.

    Returns both generations and which finished first.
    """
    held = hold_pass(backend, 3)
    finished: list[str] = []

    async def request(prompt, params, name):
        [out] = await backend.generate(prompt, params, name)
        finished.append(name)
        return out

    async def main():
        long = asyncio.create_task(request([1, 5, 6], SamplingParams(max_new_tokens=40, temperature=0), "long"))
        await held.reached(long)
        short = asyncio.create_task(request([1, 9, 10, 11, 12], short_params, "short"))
        await asyncio.sleep(0)  # one turn: it is queued
        held.release()
        return await asyncio.gather(long, short)

    long, short = asyncio.run(main())
    return long, short, finished


@pytest.mark.loaded
def test_a_short_request_submitted_while_a_long_one_decodes_finishes_first(tiny_hf_model_dir, hold_pass):
    backend = make_backend(tiny_hf_model_dir)
    seen = record_batches(backend)
    short_params = SamplingParams(max_new_tokens=4, temperature=0)
    long, short, finished = submit_during_a_long_request(backend, hold_pass, short_params)

    assert finished == ["short", "long"]
    # It joined at the next pass and left the pass it finished: 3 passes alone, its prefill, 3
    # passes together, then the long one alone again.
    assert seen == [(1, 3), (1, 1), (1, 1), (1, 5), (2, 1), (2, 1), (2, 1)] + [(1, 1)] * 34
    assert len(long.token_ids) == 40 and len(short.token_ids) == 4
    # Joining a running batch changes nobody's tokens.
    [long_alone] = generate(backend, [1, 5, 6], max_new_tokens=40, temperature=0)
    [short_alone] = generate(backend, [1, 9, 10, 11, 12], max_new_tokens=4, temperature=0)
    assert (long.token_ids, short.token_ids) == (long_alone.token_ids, short_alone.token_ids)


@pytest.mark.loaded
def test_with_wave_batching_the_short_request_waits_for_the_long_one(tiny_hf_model_dir, hold_pass):
    backend = make_backend(tiny_hf_model_dir, batching="wave")
    seen = record_batches(backend)
    long, short, finished = submit_during_a_long_request(
        backend, hold_pass, SamplingParams(max_new_tokens=4, temperature=0)
    )
    assert finished == ["long", "short"]
    assert seen == [(1, 3)] + [(1, 1)] * 39 + [(1, 5)] + [(1, 1)] * 3
    assert len(long.token_ids) == 40 and len(short.token_ids) == 4


def test_when_a_long_prompt_leaves_the_batch_its_padding_leaves_the_cache(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    widths: list[int] = []
    backend.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["attention_mask"].shape[1]), with_kwargs=True
    )

    async def main():
        params = SamplingParams(max_new_tokens=2, temperature=0)
        long = backend.generate([1, *range(10, 70)], params, "long-prompt")
        short = backend.generate([1, 5, 6], SamplingParams(max_new_tokens=20, temperature=0), "short")
        return await asyncio.gather(long, short)

    [[long], [short]] = asyncio.run(main())
    assert len(long.token_ids) == 2 and len(short.token_ids) == 20
    # Prefill, then one pass together (61 + 1 columns); from then on the short row alone, with
    # only its own prompt and tokens: the pass feeding its g-th token has 3 + g columns.
    assert widths == [61, 62] + [3 + g for g in range(2, 20)]
    [alone] = generate(backend, [1, 5, 6], max_new_tokens=20, temperature=0)
    assert short.token_ids == alone.token_ids


@pytest.mark.loaded
def test_a_seeded_request_joining_a_busy_batch_samples_what_it_samples_alone(tiny_hf_model_dir, hold_pass):
    backend = make_backend(tiny_hf_model_dir)
    mine = SamplingParams(max_new_tokens=24, seed=7, top_k=50, temperature=0.9)
    [alone] = generate(backend, [1, 50, 51, 52, 53, 54, 55, 56], max_new_tokens=24, seed=7, top_k=50, temperature=0.9)
    held = hold_pass(backend, 6)  # the crowd's 5th decode pass

    async def main():
        # Sampled, seeded rows of other lengths, some finishing (and leaving) while mine runs.
        crowd = [
            asyncio.create_task(
                backend.generate(p, SamplingParams(max_new_tokens=8 + 4 * i, temperature=1.0, seed=i), f"c{i}")
            )
            for i, p in enumerate(prompts(6))
        ]
        await held.reached(crowd[-1])
        joined = asyncio.create_task(backend.generate([1, 50, 51, 52, 53, 54, 55, 56], mine, "mine"))
        await asyncio.sleep(0)
        held.release()
        return await joined, await asyncio.gather(*crowd)

    [joined], crowd = asyncio.run(main())
    assert backend.stats.rows_per_prefill[-2:] == [6, 1]  # the crowd, then mine joining it
    assert [len(out.token_ids) for [out] in crowd] == [8 + 4 * i for i in range(6)]
    assert joined.token_ids == alone.token_ids
    # Padding and batch size change float32 summation order (~1e-7), never the tokens.
    assert torch.allclose(torch.tensor(joined.log_probs), torch.tensor(alone.log_probs), atol=1e-5)


def test_samples_beyond_max_batch_size_wait_for_room_in_the_batch(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir, max_batch_size=2)
    outs = generate(backend, [1, 3], max_new_tokens=3, seed=1, n=5)
    assert len(outs) == 5
    assert backend.stats.rows_per_prefill == [2, 2, 1]


def test_generation_calls_no_deprecated_transformers_api(tiny_hf_model_dir):
    # transformers warns at every call with a deprecated argument (``past_key_values``, from 5.24
    # on): a rollout would print one warning per forward pass until the release removing it.
    backend = make_backend(tiny_hf_model_dir, max_batch_size=2)

    async def three_rows():
        # Through a batch of two: prefills, decoding, a row leaving and a row joining the running batch.
        requests = [
            backend.generate(prompt, SamplingParams(temperature=0, max_new_tokens=2 + 6 * i), f"r{i}")
            for i, prompt in enumerate(prompts(3))
        ]
        return await asyncio.gather(*requests)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(three_rows())
    assert backend.stats.rows_per_prefill == [2, 1]
    assert [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))] == []


def test_a_seeded_request_samples_the_same_alone_or_in_a_batch(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    params = SamplingParams(max_new_tokens=24, seed=123, top_p=0.95)
    [alone] = generate(backend, [1, 50, 51, 52], max_new_tokens=24, seed=123, top_p=0.95)
    [again] = generate(backend, [1, 50, 51, 52], max_new_tokens=24, seed=123, top_p=0.95)
    assert again == alone

    async def crowded():
        # Seeded too, so which rows share each step (and so the numerics) is the same every run.
        others = [
            backend.generate(p, SamplingParams(max_new_tokens=30, temperature=0.8, seed=100 + i), "other")
            for i, p in enumerate(prompts(7))
        ]
        mine = backend.generate([1, 50, 51, 52], params, "mine")
        return await asyncio.gather(*others[:3], mine, *others[3:])

    [batched] = asyncio.run(crowded())[3]
    assert backend.stats.rows_per_prefill[-1] == 8
    # Left padding and another batch size change float32 summation order (~1e-7), never the tokens.
    assert batched.token_ids == alone.token_ids
    assert torch.allclose(torch.tensor(batched.log_probs), torch.tensor(alone.log_probs), atol=1e-5)


# -- cancel, shutdown, errors --------------------------------------------------------------


@pytest.mark.loaded
def test_a_cancelled_request_leaves_the_batch_and_the_others_complete(tiny_hf_model_dir, hold_pass):
    backend = make_backend(tiny_hf_model_dir)
    seen = record_batches(backend)
    held = hold_pass(backend, 2)  # the wave's second pass: both rows are running when one is cancelled

    async def main():
        params = SamplingParams(max_new_tokens=30, temperature=0)
        kept = asyncio.create_task(backend.generate([1, 5, 6], params, "kept"))
        doomed = asyncio.create_task(backend.generate([1, 7, 8], params, "doomed"))
        await held.reached(kept)
        queued = asyncio.create_task(backend.generate([1, 9], params, "queued"))
        await asyncio.sleep(0)  # one turn: it is queued behind the running wave
        doomed.cancel()
        queued.cancel()
        held.release()
        out = await kept
        await asyncio.gather(doomed, queued, return_exceptions=True)
        return out, doomed, queued

    [out], doomed, queued = asyncio.run(main())
    assert doomed.cancelled() and queued.cancelled()
    assert out.finish_reason == "length" and len(out.token_ids) == 30
    # Both rows in the prefill and the held pass; from the next pass on the cancelled row is gone.
    assert seen == [(2, 3), (2, 1)] + [(1, 1)] * 28
    assert backend.stats.rows_per_prefill == [2]  # the queued request never ran
    assert not backend._busy()


@pytest.mark.loaded
def test_shutdown_aborts_running_and_queued_requests(tiny_hf_model_dir, hold_pass):
    backend = make_backend(tiny_hf_model_dir)
    held = hold_pass(backend, 3)

    async def main():
        params = SamplingParams(max_new_tokens=10, temperature=0)
        running = asyncio.create_task(backend.generate([1, 5], params, "running"))
        await held.reached(running)
        queued = asyncio.create_task(backend.generate([1, 6], params, "queued"))
        await asyncio.sleep(0)  # one turn: it is queued behind the running wave
        held.release()
        await backend.shutdown()  # closed before the engine sees the third pass end
        return await running, await queued

    [running], [queued] = asyncio.run(main())
    assert running.finish_reason == "abort" and len(running.token_ids) == 3  # stopped after the held pass
    assert len(running.log_probs) == len(running.token_ids)
    assert queued == Generation([], [], "abort")
    with pytest.raises(RuntimeError, match="after shutdown"):
        generate(backend, [1, 5], max_new_tokens=2)


def test_shutdown_during_the_prefill_of_a_cancelled_request_ends_the_engine(tiny_hf_model_dir, hold_pass):
    # A request timed out while its prefill ran: the engine comes back to an empty batch and an
    # empty queue after the shutdown was asked for, and must not wait for arrivals (a run whose
    # every request timed out hung there in CI).
    backend = make_backend(tiny_hf_model_dir)
    held = hold_pass(backend, 1)

    async def main():
        doomed = asyncio.create_task(backend.generate([1, 5], SamplingParams(max_new_tokens=10), "doomed"))
        await held.reached(doomed)
        doomed.cancel()
        await asyncio.gather(doomed, return_exceptions=True)
        held.release()
        await asyncio.wait_for(backend.shutdown(), timeout=60)  # a lost wake-up waits forever
        return doomed

    assert asyncio.run(main()).cancelled()
    assert backend._engine.done() and not backend._busy()


@pytest.mark.loaded
def test_pause_aborts_running_requests_with_their_tokens_and_holds_new_ones_until_resume(
    tiny_hf_model_dir, other_hf_model_dir, hold_pass
):
    """Partial rollout: weights change under a paused engine; what arrives meanwhile waits."""
    backend = make_backend(tiny_hf_model_dir)
    other = make_backend(other_hf_model_dir)
    state = {name: tensor.clone() for name, tensor in other.model.state_dict().items()}
    held = hold_pass(backend, 3)
    params = SamplingParams(max_new_tokens=10, temperature=0)

    async def main():
        running = asyncio.create_task(backend.generate([1, 5], params, "running"))
        await held.reached(running)
        held.release()
        await backend.pause()  # paused before the engine sees the third pass end
        assert running.done()  # pause returns once nothing runs
        waiting = asyncio.create_task(
            backend.generate([1, 60, 61, 62], SamplingParams(max_new_tokens=8, temperature=0), "w")
        )
        await asyncio.sleep(0)  # one turn: it is queued, and an engine that ignored the pause is woken
        # The update's round trip to the worker thread gives that engine its turn first: it would
        # have taken a wave (counted before its first await) by the time the update returns.
        await backend.update_weights(one_bucket(state))
        assert not waiting.done() and backend.stats.rows_per_prefill == [1]
        await backend.resume()
        return await running, await waiting

    [partial], [after] = asyncio.run(main())
    assert partial.finish_reason == "abort" and len(partial.token_ids) == 3  # stopped after the held pass
    assert len(partial.log_probs) == len(partial.token_ids)
    [target] = generate(other, [1, 60, 61, 62], max_new_tokens=8, temperature=0)
    assert after.token_ids == target.token_ids  # generated after the pause, with the new weights


def test_pause_and_resume_of_an_idle_engine_return_at_once(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)

    async def main():
        pausing = asyncio.create_task(backend.pause())
        await asyncio.sleep(0)  # one turn of the loop: an idle engine has nothing to wait for
        assert pausing.done()  # a pause that waited for a wave would never end: fail, not hang
        await backend.resume()
        return await backend.generate([1, 5], SamplingParams(max_new_tokens=3, temperature=0), "r")

    [out] = asyncio.run(main())
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_a_forward_error_fails_its_wave_and_the_engine_keeps_serving(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    failures = [RuntimeError("device lost")]

    def fail_once(module, args, kwargs):
        if failures:
            raise failures.pop()

    backend.model.register_forward_pre_hook(fail_once, with_kwargs=True)

    async def main():
        params = SamplingParams(max_new_tokens=4, temperature=0)
        failed = await asyncio.gather(*(backend.generate(p, params, "r") for p in prompts(3)), return_exceptions=True)
        return failed, await backend.generate([1, 5], params, "after")

    failed, [after] = asyncio.run(main())
    assert [str(exc) for exc in failed] == ["device lost"] * 3
    assert after.finish_reason == "length" and len(after.token_ids) == 4


# -- weights, sleep, loops -----------------------------------------------------------------


def test_update_weights_makes_the_backend_generate_like_the_other_model(tiny_hf_model_dir, other_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    other = make_backend(other_hf_model_dir)
    prompt = [1, 60, 61, 62]
    [before] = generate(backend, prompt, max_new_tokens=12, temperature=0)
    [target] = generate(other, prompt, max_new_tokens=12, temperature=0)
    assert before.token_ids != target.token_ids
    state = {name: tensor.to(torch.float64) for name, tensor in other.model.state_dict().items()}
    asyncio.run(backend.update_weights(one_bucket(state)))
    [after] = generate(backend, prompt, max_new_tokens=12, temperature=0)
    assert after.token_ids == target.token_ids


def test_update_weights_refuses_unknown_names_and_wrong_shapes(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    with pytest.raises(KeyError, match=r"no weights named not\.a\.weight"):
        asyncio.run(backend.update_weights(one_bucket({"not.a.weight": torch.zeros(1)})))
    with pytest.raises(ValueError, match=r"lm_head\.weight has shape"):
        asyncio.run(backend.update_weights(one_bucket({"lm_head.weight": torch.zeros(3, 3)})))


def test_a_sleeping_backend_refuses_requests_until_woken(tiny_hf_model_dir):
    backend = make_backend(tiny_hf_model_dir)
    asyncio.run(backend.sleep())
    with pytest.raises(RuntimeError, match="asleep"):
        generate(backend, [1, 5], max_new_tokens=2)
    asyncio.run(backend.wake_up())
    # A fresh event loop per call (asyncio.run each time) gets a fresh engine task.
    assert len(generate(backend, [1, 5], max_new_tokens=2)[0].token_ids) == 2


def test_woken_in_two_parts_the_backend_generates_only_once_its_kv_cache_is_back(tiny_hf_model_dir):
    """The colocated order: the weights back (a sync loads into them), then the KV cache."""
    backend = make_backend(tiny_hf_model_dir)
    asyncio.run(backend.sleep(keep_weights=False))
    asyncio.run(backend.wake_up("weights"))
    with pytest.raises(RuntimeError, match="asleep"):
        generate(backend, [1, 5], max_new_tokens=2)
    asyncio.run(backend.wake_up("kv_cache"))
    assert len(generate(backend, [1, 5], max_new_tokens=2)[0].token_ids) == 2


# -- config and registration ---------------------------------------------------------------


def test_the_plugin_registers_the_hf_backend_and_its_section():
    assert "hf" in registry().backends
    assert registry().sections["rollout.hf"] is HFOptions


def test_the_section_arrives_validated_from_the_run_config(tiny_hf_model_dir):
    """Through the declared section, as a run hands it over: the run config's ``rollout.hf``."""
    config = OmegaConf.create({"rollout": {"hf": {"device": "cpu", "dtype": "bfloat16", "max_batch_size": 3}}})
    backend = create_backend("hf", parse_sections(config, registry().sections), tiny_hf_model_dir)
    assert backend.model.dtype == torch.bfloat16
    assert backend.options.max_batch_size == 3


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        ({"device": "tpu"}, "rollout.hf.device: expected 'auto', 'cpu' or 'cuda', got 'tpu'"),
        ({"dtype": "int8"}, "rollout.hf.dtype: expected 'float32', 'bfloat16' or 'float16', got 'int8'"),
        ({"max_batch_size": 0}, "rollout.hf.max_batch_size: expected an integer > 0, got 0"),
        (
            {"max_batch": 8},
            "rollout.hf.max_batch: unknown key (allowed: batching, config_overrides, device, dtype, max_batch_size); "
            "did you mean rollout.hf.max_batch_size?",
        ),
    ],
)
def test_bad_hf_settings_name_the_key(hf, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        parse_sections({"rollout": {"hf": hf}}, registry().sections)


def test_a_model_path_that_is_not_a_model_directory_names_model_path(tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.path: .* \(no config\.json\)"):
        make_backend(tmp_path)
