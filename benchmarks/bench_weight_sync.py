"""Weight sync at size, across two Ray nodes: the trainer's bucketed path against a raw transfer.

A 0.5B-parameter Qwen2-shaped policy (Qwen2-0.5B's config, random weights, built here: nothing is
downloaded) sits in a ``Policy`` actor on node A; 1, then 4, hf rollout workers on node B hold
the same model. Each sync is the trainer's own path (``RolloutGroup.update_weights``: the actor
publishes, each bucket goes into the object store once and is loaded by every worker, one bucket
ahead). Beside it, in the same run, the raw transfer of the same bytes: ``ray.put`` of one array
on node A, ``ray.get`` on node B and a copy into a preallocated buffer (what a load does).

Both nodes run on this machine, each in its own mount namespace with a private /dev/shm (see
tests/ray_nodes.py; needs root). Each configuration gets fresh processes whose weights are made
resident first, so the extra peak RSS (the peak during the first sync minus the resident size
before it, object-store pages mapped by the process included) is what one sync adds. Pages of
the object store a process has touched stay in its RSS after their object is freed, so that
column counts every bucket a process saw; the object stores' own peak (sampled) counts what was
held at once.

    python benchmarks/bench_weight_sync.py --rounds 3 --bucket-mb 512
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from ray_nodes import namespaces_refused, node_env, two_nodes  # noqa: E402

QWEN2_05B = {  # Qwen/Qwen2-0.5B's config.json
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
MB = 1 << 20


def build_model(directory: Path, layers: int | None) -> Path:
    """The policy's model directory, with the embedded task's tokenizer (the model's vocabulary is
    larger, as a real model's is than the prompts it sees)."""
    import torch
    from skip_plugin_arithmetic.task import ArithmeticOptions, ArithmeticTask
    from transformers import Qwen2Config, Qwen2ForCausalLM

    task = ArithmeticTask().prepare(directory / "task", ArithmeticOptions(warmup_steps=0), progress=False)
    config = Qwen2Config(**{**QWEN2_05B, **({"num_hidden_layers": layers} if layers else {})})
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    path = directory / "qwen2"
    model.save_pretrained(path)
    for name in os.listdir(task.model_path):
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(Path(task.model_path) / name, path / name)
    return path


# -- what runs on the head node (the driver) --------------------------------------------------------


def _pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def _touch(model) -> None:
    """Make the model's pages resident and private (a loaded model may still be a file mapping,
    whose pages a first sync would fault in and count as its own)."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0)


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class Peak:
    """The extra peak resident memory of some processes over a block (``/proc/PID/clear_refs`` 5
    resets the kernel's high-water mark)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def __enter__(self) -> Peak:
        self.before = {}
        for pid in self.pids:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            self.before[pid] = _status(pid, "VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.extra = {pid: _status(pid, "VmHWM") - self.before[pid] for pid in self.pids}


class StorePeak:
    """The most the object stores of both nodes held at once over a block, sampled (~0.1 s)."""

    def __enter__(self) -> StorePeak:
        self.peak, self._done = 0, threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        from ray._private.internal_api import memory_summary

        while not self._done.is_set():
            used = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(stats_only=True))
            self.peak = max(self.peak, int(used.group(1)) * MB if used else 0)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._sampler.join()


class Sender:
    def __init__(self, nbytes: int) -> None:
        import numpy as np

        self.array = np.ones(nbytes, dtype=np.uint8)

    def put(self) -> list:
        import ray

        return [ray.put(self.array)]


class Receiver:
    def __init__(self, nbytes: int) -> None:
        import numpy as np

        self.buffer = np.ones(nbytes, dtype=np.uint8)  # resident, as an engine's weights are

    def get(self, refs: list) -> int:
        import numpy as np
        import ray

        np.copyto(self.buffer, ray.get(refs[0]))
        return int(self.buffer[-1])


def raw(nbytes: int, rounds: int) -> dict:
    import ray

    sender = ray.remote(Sender).options(resources={"node_a": 0.01}).remote(nbytes)
    receiver = ray.remote(Receiver).options(resources={"node_b": 0.01}).remote(nbytes)
    pids = [_pid(sender), _pid(receiver)]
    times, extra, store = [], None, 0
    for _ in range(rounds):
        with Peak(pids) as peak, StorePeak() as stored:
            start = time.perf_counter()
            assert ray.get(receiver.get.remote(sender.put.remote())) == 1
            times.append(time.perf_counter() - start)
        extra, store = extra or peak.extra, max(store, stored.peak)
    for actor in (sender, receiver):
        ray.kill(actor)
    return {"times": times, "sender": extra[pids[0]], "receivers": [extra[pids[1]]], "store": store}


def bucketed(model: Path, workers: int, megabytes: float, rounds: int) -> dict:
    import ray
    from skip_plugin_trainer.algorithm_settings import ActorConfig
    from skip_plugin_trainer.commands import compose_config
    from skip_plugin_trainer.settings import RolloutSettings
    from skip_plugin_trainer.train.policy import Policy
    from skip_plugin_trainer.train.rollout_group import RolloutGroup, WeightSource
    from skip_plugin_trainer.train.workers import RolloutWorker

    config = compose_config(None, "run", (f"model.path={model}", "task.name=null", "rollout.hf.device=cpu"))
    settings = RolloutSettings.from_config(config)
    actor = ray.remote(Policy).options(resources={"node_a": 0.01}, num_cpus=0)
    actor = actor.remote(str(model), ActorConfig(ppo_mini_batch_size=1), samples_per_prompt=1)
    remote = ray.remote(RolloutWorker).options(resources={"node_b": 0.01}, num_cpus=0, max_concurrency=4)
    spawned = [remote.remote(settings, 1, rank) for rank in range(workers)]
    group = RolloutGroup(lambda: spawned)
    ray.get([w.__ray_ready__.remote() for w in [actor, *spawned]])
    ray.get(actor.__ray_call__.remote(lambda policy: _touch(policy.model)))
    ray.get([w.__ray_call__.remote(lambda worker: _touch(worker.loop.backend.model)) for w in spawned])
    source = WeightSource(actor, megabytes, keep=False)
    pids = [_pid(actor), *(_pid(w) for w in spawned)]
    times, extra, store = [], None, 0
    for version in range(1, rounds + 1):
        with Peak(pids) as peak, StorePeak() as stored:
            start = time.perf_counter()
            group.update_weights(source, version)
            times.append(time.perf_counter() - start)
        extra, store = extra or peak.extra, max(store, stored.peak)
    group.shutdown()
    for a in [actor, *spawned]:
        ray.kill(a)
    return {
        "times": times,
        "sender": extra[pids[0]],
        "receivers": [extra[p] for p in pids[1:]],
        "buckets": source.count,
        "store": store,
    }


def measure(args: argparse.Namespace) -> None:
    import ray
    from rich.console import Console
    from rich.table import Table
    from safetensors import safe_open

    ray.init(address=args.address, log_to_driver=False)
    with safe_open(str(Path(args.model) / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
        shapes = {name: weights.get_slice(name).get_shape() for name in names}
    # The saved file holds one name per storage, as a sync sends them; the policy trains in float32.
    nbytes = sum(4 * math.prod(shape) for shape in shapes.values())
    params = nbytes // 4
    table = Table(
        title=f"weight sync, {params / 1e6:.0f}M parameters ({nbytes / MB:.0f} MiB float32), node A -> node B"
    )
    for column in ("path", "workers", "buckets", "sync s (median)", "all rounds s", "x raw",
                   "object stores peak MiB", "sender extra RSS MiB", "receiver extra RSS MiB (max)"):  # fmt: skip
        table.add_column(column, justify="right" if column != "path" else "left")
    base = raw(nbytes, args.rounds)
    rows = [("raw ray.put / ray.get", 1, "-", base)]
    for workers in args.workers:
        result = bucketed(Path(args.model), workers, args.bucket_mb, args.rounds)
        rows.append((f"skip, {args.bucket_mb:g} MiB buckets", workers, None, result))
    raw_median = statistics.median(base["times"])
    for path, workers, buckets, result in rows:
        median = statistics.median(result["times"])
        table.add_row(
            path,
            str(workers),
            str(result.get("buckets", buckets)),
            f"{median:.2f}",
            " ".join(f"{t:.2f}" for t in result["times"]),
            f"{median / raw_median:.2f}",
            f"{result['store'] / MB:.0f}",
            f"{result['sender'] / MB:.0f}",
            f"{max(result['receivers']) / MB:.0f}",
        )
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick try (default: 24)")
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.address:  # inside the head's namespace
        measure(args)
        return
    why = namespaces_refused()
    if why is not None:
        sys.exit(f"two Ray nodes need a mount namespace each: {why}")
    with tempfile.TemporaryDirectory(prefix="skip-bench-sync-") as tmp:
        directory = Path(tmp)
        print("building the model ...", flush=True)
        model = build_model(directory, args.layers)
        nodes = directory / "nodes"
        nodes.mkdir()
        with two_nodes(nodes, cpus=4, object_store_bytes=3 * 10**9, shm="4g") as (head, address):
            command = ["nsenter", f"--mount=/proc/{head}/ns/mnt", sys.executable, __file__, *sys.argv[1:],
                       "--address", address, "--model", str(model)]  # fmt: skip
            subprocess.run(command, check=True, env=node_env(address))


if __name__ == "__main__":
    main()
