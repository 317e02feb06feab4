"""Throughput of the ``hf`` rollout backend against one plain ``model.generate`` call.

The same ``--requests`` prompts (random lengths of 16 to 64 tokens) and ``--max-new-tokens``,
plain sampling at temperature 1 (no top-k, no top-p), three ways:

    backend, concurrent   one ``generate`` per prompt, all awaited together with asyncio.gather:
                          what the agent loop does; the backend batches them itself
    model.generate        ONE transformers ``generate`` call on the left-padded batch of all
                          prompts, ``min_new_tokens = max_new_tokens`` (the upper bound a static
                          batch can reach, without any per-request bookkeeping)
    backend, sequential   the same requests awaited one after another (batch size 1), for contrast

The default model is a random Llama of ~5M parameters (hidden 256, 4 layers, vocabulary 4096)
without an end-of-sequence token, so every row generates ``--max-new-tokens`` tokens in every
variant. With ``--model-dir`` the backend stops rows at the model's eos; tokens/s counts the
tokens actually generated. Variants run interleaved in a new order each round after one untimed
warm-up round; the table gives the median and the best round.

Run: ``python benchmarks/bench_hf_backend.py --repeat 3``
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from skip_core.backend import SamplingParams
from skip_plugin_hf.engine import HFBackend
from skip_plugin_hf.options import HFOptions

PARAMS = {"temperature": 1.0, "top_k": -1, "top_p": 1.0}


def build_model(directory: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
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
    lines = ["{:<22} {:>16} {:>14} {:>14}".format("variant", "median tokens/s", "best tokens/s", "vs generate")]
    base = statistics.median(rates[baseline])
    for name, samples in rates.items():
        median = statistics.median(samples)
        lines.append(f"{name:<22} {median:>16,.0f} {max(samples):>14,.0f} {median / base:>13.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="a local HF model (default: a random Llama)")
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests (default 64)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds of every variant (default 3)")
    parser.add_argument("--no-sequential", action="store_true", help="skip the one-request-at-a-time variant")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-hf-") as scratch:
        model_dir = args.model_dir or build_model(Path(scratch))
        options = HFOptions(model_dir, torch.device("cpu"), torch.float32, max_batch_size=args.requests)
        backend = HFBackend(options)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        prompts = make_prompts(args.requests, model.config.vocab_size, args.seed)
        variants = {
            "backend, concurrent": lambda: backend_concurrent(backend, prompts, args.max_new_tokens),
            "model.generate": lambda: plain_generate(model, prompts, args.max_new_tokens),
        }
        if not args.no_sequential:
            variants["backend, sequential"] = lambda: backend_sequential(backend, prompts, args.max_new_tokens)
        parameters = sum(p.numel() for p in model.parameters())
        print(
            f"{parameters / 1e6:.1f}M-parameter {model.config.model_type}, {args.requests} requests x "
            f"{args.max_new_tokens} new tokens, prompts of 16-64 tokens, {torch.get_num_threads()} torch threads, "
            f"{args.repeat} rounds"
        )
        rates = measure(variants, args.repeat, args.seed)
        print("\n".join(report(rates, "model.generate")))
        waves = backend.stats.rows_per_wave
        print(f"backend waves: {len(waves)}, rows per wave: {min(waves)}-{max(waves)}")


if __name__ == "__main__":
    main()
