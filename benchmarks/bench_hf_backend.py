"""Throughput of the ``hf`` rollout backend: continuous batching, waves, one ``model.generate`` call.

Uniform batch: the same ``--requests`` prompts (random lengths of 16 to 64 tokens) and
``--max-new-tokens``, plain sampling at temperature 1 (no top-k, no top-p):

    backend, concurrent   one ``generate`` per prompt, all awaited together with asyncio.gather:
                          what the agent loop does; the backend batches them itself (continuous)
    backend, waves        the same on a backend with ``batching: wave`` (rows join only an empty batch)
    model.generate        ONE transformers ``generate`` call on the left-padded batch of all
                          prompts, ``min_new_tokens = max_new_tokens`` (the upper bound a static
                          batch can reach, without any per-request bookkeeping)
    backend, sequential   the same requests awaited one after another (batch size 1), for contrast

Multi-turn, long tail: every request runs ``--turns`` turns, each continuing the last with a few
"tool" tokens; one request in eight asks for 8x ``--max-new-tokens`` / 4 tokens per turn, the
others for ``--max-new-tokens`` / 4, on backends batching at most a quarter of the requests.
Continuous batching against waves: with waves, a finished turn's next one, and every request
still queued, waits for the longest row of the wave.

The default model is a random Llama of ~5M parameters (hidden 256, 4 layers, vocabulary 4096)
without an end-of-sequence token, so every row generates the tokens it asks for. With
``--model-dir`` the backend stops rows at the model's eos; tokens/s counts the tokens actually
generated. Variants run interleaved in a new order each round after one untimed warm-up round;
the tables give the median and the best round.

Run: ``python benchmarks/bench_hf_backend.py --repeat 3``
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from skip_core.backend import SamplingParams
from skip_plugin_arithmetic.tiny_model import llama
from skip_plugin_hf.engine import HFBackend
from skip_plugin_hf.resolved import Resolved

PARAMS = {"temperature": 1.0, "top_k": -1, "top_p": 1.0}


def build_model(directory: Path) -> Path:
    shape = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4}
    special = {"bos_token_id": 1, "eos_token_id": None, "pad_token_id": 0}
    llama(4096, 0, **shape, num_key_value_heads=4, max_position_embeddings=2048, **special).save_pretrained(directory)
    return directory


def make_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in range(count)]


def backend_concurrent(backend: HFBackend, prompts: list[list[int]], max_new_tokens: int) -> int:
    async def run():
        params = SamplingParams(max_new_tokens=max_new_tokens, **PARAMS)
        return await asyncio.gather(*(backend.generate(p, params, f"r{i}") for i, p in enumerate(prompts)))

    return sum(len(out.token_ids) for [out] in asyncio.run(run()))


def backend_sequential(backend: HFBackend, prompts: list[list[int]], max_new_tokens: int) -> int:
    async def run():
        params = SamplingParams(max_new_tokens=max_new_tokens, **PARAMS)
        return [await backend.generate(p, params, f"r{i}") for i, p in enumerate(prompts)]

    return sum(len(out.token_ids) for [out] in asyncio.run(run()))


def backend_turns(backend: HFBackend, prompts: list[list[int]], max_new_tokens: int, turns: int) -> int:
    async def request(i: int, prompt: list[int]) -> int:
        budget = max(1, max_new_tokens // 4) * (8 if i % 8 == 0 else 1)
        params = SamplingParams(max_new_tokens=budget, **PARAMS)
        tokens = 0
        for turn in range(turns):
            [out] = await backend.generate(prompt, params, f"r{i}t{turn}")
            prompt = [*prompt, *out.token_ids, 3, 4, 5]  # a tool's answer between turns
            tokens += len(out.token_ids)
        return tokens

    async def run():
        return await asyncio.gather(*(request(i, p) for i, p in enumerate(prompts)))

    return sum(asyncio.run(run()))


def plain_generate(model: transformers.PreTrainedModel, prompts: list[list[int]], max_new_tokens: int) -> int:
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
            **{**PARAMS, "top_k": None},
        )
    return (out.shape[1] - width) * len(prompts)


def measure(variants: dict[str, Callable[[], int]], repeat: int, seed: int) -> dict[str, list[float]]:
    """Tokens per second of each variant in each timed round."""
    rng = random.Random(seed)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(repeat + 1):
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            tokens = variants[name]()
            seconds = time.perf_counter() - start
            if round_ > 0:  # round 0 warms up allocators and kernels
                rates[name].append(tokens / seconds)
    return rates


def report(rates: dict[str, list[float]], baseline: str) -> list[str]:
    lines = ["{:<28} {:>16} {:>14} {:>14}".format("variant", "median tokens/s", "best tokens/s", f"vs {baseline}")]
    base = statistics.median(rates[baseline])
    for name, samples in rates.items():
        median = statistics.median(samples)
        lines.append(f"{name:<28} {median:>16,.0f} {max(samples):>14,.0f} {median / base:>13.2f}x")
    return lines


def mean_rows(backend: HFBackend) -> str:
    stats = backend.stats
    return f"{stats.rows_per_pass / max(stats.decode_passes, 1):.1f} rows per decode pass"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="a local HF model (default: a random Llama)")
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests (default 64)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds of every variant (default 3)")
    parser.add_argument("--turns", type=int, default=3, help="turns per request, multi-turn table (default 3)")
    parser.add_argument("--no-sequential", action="store_true", help="skip the one-request-at-a-time variant")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-hf-") as scratch:
        model_dir = args.model_dir or build_model(Path(scratch))
        options = Resolved(model_dir, torch.device("cpu"), torch.float32, max_batch_size=args.requests)
        continuous = HFBackend(options)
        # The multi-turn table gives each backend room for a quarter of the requests: more work
        # than fits one batch, as when a rollout worker serves more requests than it batches.
        room = dataclasses.replace(options, max_batch_size=max(1, args.requests // 4))
        waves = HFBackend(dataclasses.replace(options, batching="wave"))
        few, few_waves = HFBackend(room), HFBackend(dataclasses.replace(room, batching="wave"))
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        prompts = make_prompts(args.requests, model.config.vocab_size, args.seed)
        new = args.max_new_tokens
        uniform = {
            "backend, concurrent": lambda: backend_concurrent(continuous, prompts, new),
            "backend, waves": lambda: backend_concurrent(waves, prompts, new),
            "model.generate": lambda: plain_generate(model, prompts, new),
        }
        if not args.no_sequential:
            uniform["backend, sequential"] = lambda: backend_sequential(continuous, prompts, new)
        turns = {
            "backend, waves": lambda: backend_turns(few_waves, prompts, new, args.turns),
            "backend, continuous": lambda: backend_turns(few, prompts, new, args.turns),
        }
        parameters = sum(p.numel() for p in model.parameters())
        print(
            f"{parameters / 1e6:.1f}M-parameter {model.config.model_type}, {args.requests} requests, prompts of "
            f"16-64 tokens, {torch.get_num_threads()} torch threads, {args.repeat} rounds"
        )
        print(f"\nuniform batch: {new} new tokens per request")
        print("\n".join(report(measure(uniform, args.repeat, args.seed), "model.generate")))
        print(
            f"\n{args.turns} turns per request, {new // 4} new tokens per turn, 8x that for one request in 8; "
            f"max_batch_size {room.max_batch_size}"
        )
        print("\n".join(report(measure(turns, args.repeat, args.seed), "backend, waves")))
        print(f"continuous: {mean_rows(few)}; waves: {mean_rows(few_waves)}")


if __name__ == "__main__":
    main()
