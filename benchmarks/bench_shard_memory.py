"""What sharding the policy with FSDP2 divides: its parameters, gradients and AdamW state, per rank.

A Qwen2-0.5B-shaped model (its config, random weights, float32, built here and saved with
``save_pretrained`` in a temporary directory: nothing is downloaded), then, for each N of
``--workers``, N fresh processes (spawned), one rank each of the real ``Policy``: rank 0's
rendezvous on 127.0.0.1, gloo, ``fully_shard`` on each decoder layer and on the root (a single
rank: no group, the plain model). Every rank takes the log-probs of its share of one synthetic
batch (verl's layout: prompts left-padded, responses right-padded), then runs one real update
(``update_share``) on its share of each mini-batch, cut as the driver's ``ModelGroup.update`` cuts
it (with the mini-batches' ``totals``). Each rank reports the bytes of its local tensors (a
DTensor's ``to_local()``): parameters, gradients and AdamW state (``exp_avg``, ``exp_avg_sq``,
``step``); and its peak RSS (``getrusage``'s ``ru_maxrss``) before the model is built, after it
is built (one rank: loaded whole; several: each reading its shards) and after the updates. It
updates twice and also reports the second update's own peak (the kernel's high-water mark reset
between them: AdamW's state then exists) beside ``skip run --check``'s estimate (``memory.py``),
and each update's time beside the first variant's: the step cost of bfloat16 and checkpointing
on this CPU. Ranks of one N run at the same time and share the machine's CPUs (``torch`` threads:
the CPUs over N). Offload moves nothing on a CPU: it has no column here.

    python benchmarks/bench_shard_memory.py --layers 2
    python benchmarks/bench_shard_memory.py --workers 1 2            # the full 24 layers: ~10 GB for N=1
    python benchmarks/bench_shard_memory.py --layers 2 --variants float32 float32+checkpointing bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from skip_plugin_trainer.memory import Plan, Shape, estimate

QWEN2_05B = {  # Qwen/Qwen2-0.5B's shape
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}
MIB = 1 << 20
VARIANTS = {  # name: (fsdp_config.dtype, model.enable_gradient_checkpointing)
    "float32": ("float32", False),
    "float32+checkpointing": ("float32", True),
    "bfloat16": ("bfloat16", False),
    "bfloat16+checkpointing": ("bfloat16", True),
}


def build_model(rank: int, directory: str, layers: int, untied: bool) -> None:
    """Random weights in Qwen2-0.5B's shape (``layers`` decoder layers; ``untied``: a head of its
    own, as Qwen2.5-7B has), saved as safetensors. Spawned, so that the driver never holds the model."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    config = {**QWEN2_05B, "num_hidden_layers": layers, "tie_word_embeddings": not untied}
    Qwen2ForCausalLM(Qwen2Config(**config)).save_pretrained(directory)


def synthetic_batch(samples: int, prompt: int, response: int, vocab: int):
    """``samples`` rows of at most ``prompt`` + ``response`` tokens, random ids, ragged lengths (the
    first row uses both widths whole); ``advantages`` of either sign. The same in every rank."""
    import torch
    from skip_core.batch import Batch

    generator = torch.Generator().manual_seed(0)
    prompt_lengths = torch.randint(prompt // 2, prompt + 1, (samples,), generator=generator)
    response_lengths = torch.randint(response // 2, response + 1, (samples,), generator=generator)
    prompt_lengths[0], response_lengths[0] = prompt, response
    prompt_mask = (torch.arange(prompt) >= prompt - prompt_lengths[:, None]).long()
    response_mask = (torch.arange(response) < response_lengths[:, None]).long()
    prompts = torch.randint(1, vocab, (samples, prompt), generator=generator) * prompt_mask
    responses = torch.randint(1, vocab, (samples, response), generator=generator) * response_mask
    positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
    advantages = torch.randn(samples, 1, generator=generator) * response_mask
    return Batch(
        {
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "position_ids": torch.cat([positions, positions[:, -1:] + torch.arange(1, response + 1)], 1),
            "responses": responses,
            "response_mask": response_mask,
            "advantages": advantages.float(),
        }
    )


def peak_rss() -> int:
    """The process's peak resident set so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident() -> dict[str, int]:
    """The process's resident set now and its file-backed part (pages of mapped files), in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "RssFile", "VmHWM")}


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def rank_main(rank: int, world: int, address: str, options: dict, out: str) -> None:
    """One rank: build the ``Policy``, take log-probs of its share, update on it twice (the
    second update's peak is the steady one: AdamW's state exists), report."""
    import torch
    from skip_plugin_trainer.config.algorithm import ActorConfig, FsdpConfig, Optim
    from skip_plugin_trainer.config.sections import ModelConfig
    from skip_plugin_trainer.train.distributed import Group
    from skip_plugin_trainer.train.model_group import update_shares
    from skip_plugin_trainer.train.policy import Policy

    before, before_rss = peak_rss(), resident()["VmRSS"]
    config = ActorConfig(
        ppo_mini_batch_size=options["samples"],  # one optimizer step over the whole batch
        ppo_micro_batch_size=options["micro"],
        optim=Optim(lr=1e-5),
        fsdp_config=FsdpConfig(dtype=options["dtype"]),
    )
    group = Group(rank, world, address) if world > 1 else None
    policy = Policy(
        options["model"],
        config,
        samples_per_prompt=1,
        threads=max(1, options["cpus"] // world),
        group=group,
        device="cpu",
        model_config=ModelConfig(enable_gradient_checkpointing=options["checkpointing"]),
    )
    built, built_file = peak_rss(), resident()["RssFile"]
    batch = synthetic_batch(options["samples"], options["prompt"], options["response"], QWEN2_05B["vocab_size"])
    share = update_shares(batch, options["samples"], world)[rank]
    share.batch["old_log_probs"] = policy.compute_log_prob(share).batch["old_log_probs"]
    policy.update_share(share)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM: the next peak is the second update's
    start = time.perf_counter()
    metrics = policy.update_share(share)
    seconds = time.perf_counter() - start
    now = resident()
    model, optimizer = policy.model, policy.optimizer
    result = {
        "params": local_bytes(model.parameters()),
        "grads": local_bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer": local_bytes(
            value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)
        ),
        "before": before,
        "built": built,
        "peak": peak_rss(),
        "built_file": built_file,
        "now": now["VmRSS"],
        "now_file": now["RssFile"],
        "update_s": seconds,
        "update_peak": resident()["VmHWM"] - before_rss,
        "grad_norm": metrics.means["actor/grad_norm"][0],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(world: int, options: dict, directory: Path) -> list[dict]:
    import torch.multiprocessing as mp

    out = directory / f"workers{world}"
    out.mkdir()
    address = f"127.0.0.1:{free_port()}"
    mp.spawn(rank_main, args=(world, address, options, str(out)), nprocs=world, join=True)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2-0.5B: 24; 2 for a quick check)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], metavar="N", help="ranks to compare")
    parser.add_argument("--samples", type=int, default=4, help="samples in the batch (one mini-batch)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt width (tokens)")
    parser.add_argument("--response", type=int, default=64, help="response width (tokens)")
    parser.add_argument("--micro", type=int, default=2, help="samples per forward/backward (ppo_micro_batch_size)")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=["float32", "bfloat16+checkpointing"],
        help="compute dtype and gradient checkpointing, each measured in turn (float32 weights in all)",
    )
    parser.add_argument(
        "--untied", action="store_true", help="a head of its own (Qwen2.5-7B's and 32B's), not the embedding's"
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="the ranks' MALLOC_MMAP_THRESHOLD_: glibc then maps every allocation of this size or more on its own and "
        "unmaps it when freed (default: glibc's, which rises up to 32 MiB and keeps freed blocks below it)",
    )
    args = parser.parse_args()
    if args.mmap_threshold is not None:  # read by glibc when each spawned process starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    for world in args.workers:
        if args.samples % world:
            parser.error(f"--samples {args.samples} does not split over {world} ranks")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench-shard-memory-") as tmp:
        model = Path(tmp) / "model"
        mp.spawn(build_model, args=(str(model), args.layers, args.untied), nprocs=1, join=True)
        options = {
            "model": str(model),
            "samples": args.samples,
            "prompt": args.prompt,
            "response": args.response,
            "micro": args.micro,
            "cpus": os.cpu_count() or 1,
        }
        results, estimates = {}, {}
        for variant in args.variants:
            dtype, checkpointing = VARIANTS[variant]
            directory = Path(tmp, variant)
            directory.mkdir()
            for world in args.workers:
                measured = run(world, {**options, "dtype": dtype, "checkpointing": checkpointing}, directory)
                results[variant, world] = measured
                plan = Plan(
                    ranks=world, master="float32", compute=dtype, trainable=True, reference=False,
                    checkpointing=checkpointing, tokens=args.micro * (args.prompt + args.response),
                    responses=args.micro * args.response, chunk=None, entropy=False,
                )  # fmt: skip
                estimates[variant, world] = sum(estimate(Shape.read(model), plan).values())

    first = (args.variants[0], args.workers[0])
    base = results[first][0]
    base_state = base["params"] + base["grads"] + base["optimizer"]
    malloc = f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold is not None else ""
    table = Table(
        title=f"Policy sharded with FSDP2, per rank: Qwen2-0.5B shape{' (untied head)' if args.untied else ''}, "
        f"{args.layers} layers, float32 weights, "
        f"{args.samples} x ({args.prompt} + {args.response}) tokens, micro-batch {args.micro}{malloc}"
    )
    columns = ("variant", "N", "rank", "params MiB", "grads MiB", "optimizer MiB", "state MiB", "state / first")
    columns += ("RSS before model MiB", "peak RSS built MiB (file-backed now)", "peak RSS MiB", "peak RSS / first")
    columns += ("RSS after MiB (file-backed)", "update s", "update s / first", "grad norm")
    columns += ("update peak MiB", "estimate MiB", "estimate / peak")
    for column in columns:
        table.add_column(column, justify="left" if column == "variant" else "right")
    for (variant, world), ranks in results.items():
        for rank, r in enumerate(ranks):
            state = r["params"] + r["grads"] + r["optimizer"]
            table.add_row(
                variant,
                str(world),
                str(rank),
                *(f"{r[key] / MIB:,.0f}" for key in ("params", "grads", "optimizer")),
                f"{state / MIB:,.0f}",
                f"{state / base_state:.2f}",
                f"{r['before'] / MIB:,.0f}",
                f"{r['built'] / MIB:,.0f} ({r['built_file'] / MIB:,.0f})",
                f"{r['peak'] / MIB:,.0f}",
                f"{r['peak'] / base['peak']:.2f}",
                f"{r['now'] / MIB:,.0f} ({r['now_file'] / MIB:,.0f})",
                f"{r['update_s']:.1f}",
                f"{r['update_s'] / base['update_s']:.2f}",
                f"{r['grad_norm']:.4g}",
                f"{r['update_peak'] / MIB:,.0f}",
                f"{estimates[variant, world] / MIB:,.0f}",
                f"{estimates[variant, world] / r['update_peak']:.2f}",
            )
    Console(width=280).print(table)


if __name__ == "__main__":
    main()
