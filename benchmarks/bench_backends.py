"""Rollout backends driven by skip's agent loop against the engine's own batch generation, and the
time to push new weights into each.

The same ``--requests`` prompts of the embedded task (chat template applied), greedy, at most
``--max-new-tokens`` each, single-turn (no tools), run as:

    vllm, engine itself      every request sent straight to vLLM's AsyncLLM at once (asyncio.gather):
                             the engine's own continuous batching, no skip code in the way
    vllm, skip agent loop    AgentLoop.generate_sequences on the vllm backend: the path of a rollout
    sglang, engine itself    every prompt in one call of SGLang's Engine.async_generate: its own batch
    sglang, skip agent loop  the agent loop on the sglang backend (a request per sample, seeded)
    hf, skip agent loop      the same on the hf backend (CPU reference)

``vs engine`` is a variant's rate over its own engine's (hf's: over the first engine's).
``--engines`` picks the engines (on CPU, sglang runs through tests/sglang_cpu, which the script
puts on the path where torch finds no CUDA).

The model has the embedded default's shape (Llama, 2 layers, hidden 256, head_dim 32) with its
own weights plus noise and a sharpened final norm, so greedy decoding runs long instead of
stopping after a few tokens. tokens/s counts the tokens generated. Variants run interleaved, in
a new order each round after one untimed warm-up; the table gives medians. ``weight sync`` is
``update_weights`` of the full state dict (median of 5), with ``--sync-model 0.5b`` on a 0.5B
Qwen2-shaped model built from a config with random weights (nothing is downloaded).

Run: ``python benchmarks/bench_backends.py --requests 64 256 --repeat 3``
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from skip_core.backend import create_backend, one_bucket
from skip_core.batch import Batch
from skip_core.sections import Sections
from skip_plugin_arithmetic.task import ArithmeticOptions, ArithmeticTask, problems, prompt
from skip_plugin_hf.options import HFOptions
from skip_plugin_sglang.options import SGLangOptions
from skip_plugin_trainer.config.sections import LoopConfig
from skip_plugin_trainer.rollout.agent_loop import AgentLoop
from skip_plugin_vllm.options import VLLMOptions
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from skiptests import sglang_on_cpu


def build_model(directory: Path) -> Path:
    options = ArithmeticOptions(train_size=64, val_size=8)
    model_dir = ArithmeticTask().prepare(directory, options, progress=False).model_path
    weights = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    noisy = {k: w + w.std() * torch.randn(w.shape, generator=generator) for k, w in weights.items() if w.dim() > 1}
    weights.update(noisy)
    weights["model.norm.weight"] = weights["model.norm.weight"] * 4
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


def build_half_billion(directory: Path, tokenizer_dir: Path) -> Path:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return directory


# The backends' options, as a run would validate them from its config.
ENGINES = Sections(
    VLLMOptions(dtype="float32", max_model_len=1024, enforce_eager=True, cpu_kvcache_space_gb=2),
    SGLangOptions(dtype="float32", context_length=1024),
    HFOptions(device="cpu", max_batch_size=256),
)


class Bench:
    def __init__(self, model_dir: Path, requests: int, max_new_tokens: int, engines: list[str]) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.messages = [prompt(expression) for expression, _ in problems("bench", requests, seed=0)]
        self.ids = [
            self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"]
            for m in self.messages
        ]
        self.max_new_tokens = max_new_tokens
        self.backends = {name: create_backend(name, ENGINES, model_dir) for name in [*engines, "hf"]}
        config = LoopConfig(prompt_length=256, response_length=max_new_tokens, temperature=0.0, seed=0)
        self.loops = {name: AgentLoop(backend, self.tokenizer, config) for name, backend in self.backends.items()}

    def engine_itself(self, name: str) -> int:
        return self.vllm_itself() if name == "vllm" else self.sglang_itself()

    def sglang_itself(self) -> int:
        backend = self.backends["sglang"]
        params = {"temperature": 0.0, "max_new_tokens": self.max_new_tokens}
        call = backend.engine.async_generate(input_ids=self.ids, sampling_params=params, return_logprob=True)
        # The engine serves the backend's loop (its tokenizer manager binds to the loop of its first call).
        outputs = backend._loop.run(call)
        return sum(len(out["meta_info"]["output_token_logprobs"]) for out in outputs)

    def vllm_itself(self) -> int:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            temperature=0.0, max_tokens=self.max_new_tokens, logprobs=0, stop_token_ids=[self.tokenizer.eos_token_id]
        )

        vllm = self.backends["vllm"]

        async def one(i: int, ids: list[int]) -> int:
            async for out in vllm.engine.generate(TokensPrompt(prompt_token_ids=ids), params, f"direct-{i}"):
                final = out
            return len(final.outputs[0].token_ids)

        async def every() -> list[int]:
            return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(self.ids)))

        # The engine serves the backend's loop (vLLM binds its output handler to one loop).
        return sum(vllm._loop.run(every()))

    def agent_loop(self, name: str) -> int:
        batch = Batch.from_dict(non_tensors={"raw_prompt": self.messages}, meta_info={"global_steps": 1})
        out = self.loops[name].generate_sequences(batch)
        return int(out.batch["response_mask"].sum())


def timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def sync_seconds(backend, state: dict, repeat: int = 5) -> float:
    loop = asyncio.new_event_loop()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        loop.run_until_complete(backend.update_weights(one_bucket(state)))
        times.append(time.perf_counter() - start)
    loop.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sync-model", choices=["embedded", "0.5b"], default="embedded")
    parser.add_argument("--engines", nargs="+", choices=["vllm", "sglang"], default=["vllm", "sglang"])
    args = parser.parse_args()
    if "sglang" in args.engines:
        sglang_on_cpu()
    with tempfile.TemporaryDirectory(prefix="skip-bench-backends-") as tmp:
        model_dir = build_model(Path(tmp) / "embedded")
        bench = Bench(model_dir, max(args.requests), args.max_new_tokens, args.engines)
        print(f"{'variant':<24} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'vs engine':>9}")
        messages, ids = bench.messages, bench.ids
        for count in args.requests:
            bench.messages, bench.ids = messages[:count], ids[:count]
            variants = {}
            for engine in args.engines:
                variants[f"{engine}, engine itself"] = functools.partial(bench.engine_itself, engine)
                variants[f"{engine}, skip agent loop"] = functools.partial(bench.agent_loop, engine)
            variants["hf, skip agent loop"] = functools.partial(bench.agent_loop, "hf")
            runs: dict[str, list[tuple[float, int]]] = {name: [] for name in variants}
            for round_ in range(args.repeat + 1):
                order = list(variants)
                random.Random(round_).shuffle(order)
                for name in order:
                    result = timed(variants[name])
                    if round_:
                        runs[name].append(result)
            rates = {name: statistics.median(t / s for s, t in results) for name, results in runs.items()}
            for name, results in runs.items():
                seconds, tokens = statistics.median(s for s, _ in results), results[0][1]
                engine = name.split(",")[0] if name.split(",")[0] in args.engines else args.engines[0]
                ratio = rates[name] / rates[f"{engine}, engine itself"]
                print(f"{name:<24} {count:>8} {tokens:>7} {seconds:>8.2f} {rates[name]:>9.0f} {ratio:>8.2f}x")
        sync_dir = model_dir if args.sync_model == "embedded" else build_half_billion(Path(tmp) / "half", model_dir)
        state = load_file(sync_dir / "model.safetensors")
        params = sum(t.numel() for t in state.values())
        if args.sync_model == "embedded":
            backends = bench.backends
        else:
            backends = {name: create_backend(name, ENGINES, sync_dir) for name in bench.backends}
        for name, backend in backends.items():
            milliseconds = sync_seconds(backend, state) * 1000
            print(f"weight sync, {name:<6} {params / 1e6:>8.1f}M parameters: {milliseconds:>8.1f} ms")


if __name__ == "__main__":
    main()
