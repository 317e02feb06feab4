"""Would another build make the embedded model identical on every CPU? The embedded default's
warm-up (its tokenizer, model and conversations, ``skip_plugin_arithmetic``), run for ``--steps``
steps in float32 and in float64, once on torch's kernels for this CPU and once on its scalar
kernels (``ATEN_CPU_CAPABILITY=default``), each in a fresh process; then, per warm-up dtype, how
many weights differ between the two kernel paths once cast to float32 and once rounded to
bfloat16, and by how much at most. Nothing is downloaded; files go to a temporary directory.

    python benchmarks/bench_build_across_cpus.py --steps 1 5 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

WARM_UP = """
import sys, torch
from safetensors.torch import save_file
from skip_plugin_arithmetic import task, tiny_model
from skip_plugin_arithmetic.calculator import SCHEMA
from skip_plugin_arithmetic.warmup import warm_up

steps, dtype, out = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3]
conversations = task.demonstrations(task._WARMUP_PROBLEMS, 0)
tokenizer = tiny_model.build_tokenizer(tiny_model.render(conversations[: tiny_model.CORPUS_SIZE], [SCHEMA]))
model = tiny_model.build_model(tokenizer, 0).to(dtype)
warm_up(model, tokenizer, conversations, [SCHEMA], steps, seed=0, progress=False)
print(torch.backends.cpu.get_cpu_capability())
save_file({name: tensor.detach().float().clone() for name, tensor in model.state_dict().items()}, out)
"""


def warmed(steps: int, dtype: str, scalar: bool, out: Path) -> str:
    """Warm up in a fresh process (the kernel path is chosen at import); its kernel path's name."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"} if scalar else dict(os.environ)
    done = subprocess.run(
        [sys.executable, "-c", WARM_UP, str(steps), dtype, str(out)],
        env=env,
        check=True,
        text=True,
        capture_output=True,
    )
    return done.stdout.split()[-1]


def compare(a: Path, b: Path) -> tuple[int, int, int, float]:
    from safetensors.torch import load_file

    first, second = load_file(a), load_file(b)
    weights = sum(t.numel() for t in first.values())
    in_fp32 = sum(int((first[k] != second[k]).sum()) for k in first)
    in_bf16 = sum(int((first[k].bfloat16() != second[k].bfloat16()).sum()) for k in first)
    most = max(float((first[k] - second[k]).abs().max()) for k in first)
    return weights, in_fp32, in_bf16, most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 5, 20])
    args = parser.parse_args()
    table = Table(title="the embedded model's warm-up on two kernel paths of one CPU")
    for column in ("warm-up", "steps", "kernel paths", "weights", "differ (fp32)", "differ (bf16)", "max |diff|"):
        table.add_column(column)
    with tempfile.TemporaryDirectory() as tmp:
        for steps in args.steps:
            for dtype in ("float32", "float64"):
                ours, scalar = Path(tmp, f"{dtype}-{steps}.st"), Path(tmp, f"{dtype}-{steps}-scalar.st")
                paths = f"{warmed(steps, dtype, False, ours)} / {warmed(steps, dtype, True, scalar)}"
                weights, in_fp32, in_bf16, most = compare(ours, scalar)
                table.add_row(dtype, str(steps), paths, f"{weights:,}", f"{in_fp32:,}", f"{in_bf16:,}", f"{most:.2g}")
    Console().print(table)


if __name__ == "__main__":
    main()
