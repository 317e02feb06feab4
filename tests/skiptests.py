"""What the test suites of every distribution share: configs, prompt batches, a rollout stand-in,
a way to hold dumps, and the repository's paths. On ``sys.path`` through pytest's ``pythonpath``."""

from __future__ import annotations

import os
import stat
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from skip_core import Batch, SkipManager, hookimpl
from skip_core.config import Namespace

ROOT = Path(__file__).resolve().parent.parent
# The configs skip-plugin-trainer ships; `--config-dir CONFIGS` searches them first, as a user directory.
CONFIGS = ROOT / "plugins" / "trainer" / "skip_plugin_trainer" / "config"
# The small embedded task every test that rolls out or trains uses: seconds, not minutes.
SMALL = [
    "task.train_size=64",
    "task.val_size=8",
    "task.warmup_steps=5",
    "data.train_batch_size=4",
    "rollout.n=2",
    "data.max_response_length=64",
]


def make_prompts(n: int = 4, seed: int = 0, validate: bool = False) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return Batch.from_dict(
        tensors={"input_ids": torch.randint(0, 1000, (n, 8), generator=generator)},
        non_tensors={"raw_prompt": [f"prompt {seed}-{i}" for i in range(n)], "uid": [f"u{i}" for i in range(n)]},
        meta_info={"validate": validate},
    )


def run_config(dump_dir, /, role: str = "rollout", **section) -> dict:
    """A verl-shaped run config with one enabled role."""
    settings = {"enable": True, "dump_dir": str(dump_dir), "steps": [1, 2, 3], "action": "cache", **section}
    return {
        "skip": {role: settings},
        "trainer": {"experiment_name": "exp", "project_name": "proj"},
        "data": {"train_batch_size": 4, "max_prompt_length": 8, "max_response_length": 16},
        "actor_rollout_ref": {"rollout": {"n": 1}},
    }


class Generator:
    """A rollout stand-in whose output depends on its inputs and a per-call counter."""

    def __init__(self) -> None:
        self.calls = 0

    def output(self, prompts: Batch) -> Batch:
        self.calls += 1
        responses = prompts.batch["input_ids"] * 10 + self.calls
        return Batch.from_dict(
            {"responses": responses, "rollout_log_probs": torch.rand(responses.shape)},
            {"raw_prompt": prompts.non_tensor_batch["raw_prompt"], "call": np.array([self.calls] * len(prompts))},
            {"generated_by_call": self.calls},
        )

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        return self.output(prompts)

    @SkipManager.annotate(role="rollout")
    async def agenerate_sequences(self, prompts: Batch) -> Batch:
        return self.output(prompts)


class HeldDumps:
    """Holds the dumps of chosen steps until released: a disk slower than any timing could make it.

    Registered first, it runs before core's dump; ``fail`` makes the held dumps raise once released.
    """

    def __init__(self, steps, fail: bool = False) -> None:
        self.gates = {step: threading.Event() for step in steps}
        self.fail = fail

    def release(self, step: int) -> None:
        self.gates[step].set()

    @hookimpl(tryfirst=True)
    def skip_dump(self, step):
        gate = self.gates.get(step)
        if gate is None:
            return
        gate.wait(timeout=60)
        if self.fail:
            raise OSError(f"step {step}: no space left on device")


NS = Namespace("exp", "proj", 4, 1, 8, 16)


def make_batch(n: int = 4, seed: int = 0, width: int = 16) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch.from_dict(
        {
            "responses": torch.randint(0, 50_000, (n, width), generator=g),
            "log_probs": torch.rand(n, width, generator=g),
        },
        {"uid": [f"{seed}-{i}" for i in range(n)], "extra": [{"turns": i, "tools": ("calc",)} for i in range(n)]},
        {"seed": seed},
    )


def corrupt_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def modes(root) -> dict[str, int]:
    """Permission bits of ``root`` and everything under it, by relative path."""
    found = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return found


def assert_umask_modes(root, mask: int) -> None:
    for name, mode in modes(root).items():
        expected = (0o777 if (root / name).is_dir() else 0o666) & ~mask
        assert mode == expected, f"{name}: {mode:o}, expected {expected:o}"


def sglang_on_cpu() -> None:
    """SGLang's engine on CPU through the stand-ins of tests/sglang_cpu (its README says what they
    are), for this process and every process it starts: the engines' schedulers, Ray's workers,
    the commands the tests run. Never where CUDA is: there SGLang's own kernels run."""
    if torch.cuda.is_available():
        return
    folder = str(ROOT / "tests" / "sglang_cpu")
    if folder not in sys.path:
        sys.path.insert(0, folder)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))
    import sglang_on_cpu  # noqa: F401  # this process started before PYTHONPATH named the folder


def deep_tree(top, depth: int = 1_100):
    """``top/d/d/.../d`` (``depth`` levels), made one level at a time: os.makedirs recurses too."""
    os.mkdir(top)
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        fd, parent = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(parent)
    os.close(fd)
    return top
