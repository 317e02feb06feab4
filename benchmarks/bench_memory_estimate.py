"""What ``skip run --check`` estimates per GPU for Qwen2.5-7B and Qwen2.5-32B on one 8-GPU node, key
by key: float32 as skip trained before, then verl's bfloat16 compute, gradient checkpointing,
chunked log-probs, offload. Arithmetic only (``memory.py`` on each model's published shape,
written to a temporary config.json): nothing is loaded, nothing downloaded; it runs anywhere.

    python benchmarks/bench_memory_estimate.py
    python benchmarks/bench_memory_estimate.py --tokens 16384 --response 14336 --ranks 8
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table
from skip_plugin_trainer.memory import STATE, Plan, Shape, estimate, gib

MODELS = {  # the published config.json of each (hidden, layers, intermediate, heads, kv heads, vocab)
    "Qwen2.5-7B": {"hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064},
    "Qwen2.5-32B": {"hidden_size": 5120, "num_hidden_layers": 64, "intermediate_size": 27648,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064},
}  # fmt: skip


def scenarios(base: Plan) -> list[tuple[str, Plan]]:
    """Each row adds one of verl's keys to the one before."""
    fp32 = replace(base, compute="float32", checkpointing=False)
    bf16 = replace(fp32, compute="bfloat16")
    checkpointed = replace(bf16, checkpointing=True)
    chunked = replace(checkpointed, chunk=2048)
    offloaded = replace(chunked, parked=("weights", "gradients", "AdamW", "reference"))
    return [
        ("float32, none of the keys", fp32),
        ("+ fsdp_config.dtype=bfloat16", bf16),
        ("+ enable_gradient_checkpointing", checkpointed),
        ("+ entropy_from_logits_with_chunking", chunked),
        ("+ param_offload, optimizer_offload, ref offload", offloaded),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8, help="actor workers (GPUs)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the largest micro-batch")
    parser.add_argument("--response", type=int, default=7168, help="of those, response tokens")
    args = parser.parse_args()
    base = Plan(
        ranks=args.ranks, master="float32", compute="float32", trainable=True, reference=True, checkpointing=False,
        tokens=args.tokens, responses=args.response, chunk=None, entropy=True,
    )  # fmt: skip
    table = Table(
        title=f"Estimated peak per GPU (GiB), {args.ranks} ranks, a micro-batch of {args.tokens:,} tokens "
        f"({args.response:,} of response), KL reference, entropy in the loss"
    )
    names = [*estimate(Shape(1, 1, 1, 1, 1, 1, 1, True, False, False, False), base)]
    for column in ["model", "keys", *names, "update peak", "kept while generating"]:
        table.add_column(column, justify="left" if column in ("model", "keys") else "right")
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in MODELS.items():
            directory = Path(tmp, name)
            directory.mkdir()
            (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
            shape = Shape.read(directory)
            for keys, plan in scenarios(base):
                parts = estimate(shape, plan)
                kept = sum(parts[key] for key in STATE if key not in plan.parked)
                table.add_row(name, keys, *(gib(parts[n]) for n in names), gib(sum(parts.values())), gib(kept))
    Console(width=220).print(table)


if __name__ == "__main__":
    main()
