"""Weight sync at size: the trainer's bucketed path against a raw transfer of the same bytes.

A 0.5B-parameter Qwen2-shaped policy (Qwen2-0.5B's config, random weights, built here: nothing is
downloaded; ``--model embedded``: the embedded default's 1.1M-parameter model) sits in a ``Policy``
actor on node A; 1, then 4, rollout workers on node B (``--nodes 1``: on node A too) hold the same
model, in the ``hf`` engine, or (``--backend vllm``) in a vLLM engine, eager, float32, or
(``--backend sglang``) in an SGLang engine, float32 (on CPU through tests/sglang_cpu). Each sync
is the trainer's own path (``RolloutGroup.update_weights``: the actor publishes, then)

- ``--via group`` (``rollout.weight_sync=group``): the actor's rank 0 broadcasts each bucket over
  a gloo group that every engine process has joined, and each engine loads it as it arrives
  (vLLM through skip's worker extension, SGLang through ``update_weights_from_distributed``).
  Beside it, the raw transfer: one gloo broadcast of the same bytes from node A into a buffer in
  each of as many receivers. The group is formed by a first sync before the timed rounds, as a
  run forms it once (``first sync s``);
- ``--via object_store``: each bucket goes into the object store once and is loaded by every
  worker, one bucket ahead (vLLM's worker process reads each from a file in its node's /dev/shm;
  SGLang takes each in ``update_weights_from_tensor``). Beside it, the raw transfer: ``ray.put``
  of one array on node A, ``ray.get`` and a copy into a preallocated buffer by as many receivers.

Both nodes run on this machine, each in its own mount namespace with a private /dev/shm (see
tests/ray_nodes.py; needs root). Each configuration gets fresh processes whose weights are made
resident first, so the extra peak RSS (the peak during the first timed sync minus the resident
size before it, object-store pages mapped by the process included) is what one sync adds. Pages
of the object store a process has touched stay in its RSS after their object is freed, so that
column counts every bucket a process saw; the object stores' own peak (sampled) counts what was
held at once.

    python benchmarks/bench_weight_sync.py --backend vllm --workers 1 --nodes 1
    python benchmarks/bench_weight_sync.py --backend sglang --workers 1 --via object_store
    python benchmarks/bench_weight_sync.py --model embedded --workers 1

With vLLM the receiver's extra RSS is that of the worker actor and its engine's processes
together.
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
from skiptests import sglang_on_cpu  # noqa: E402

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


def build_model(directory: Path, layers: int | None, embedded: bool = False) -> Path:
    """The policy's model directory, with the embedded task's tokenizer (the model's vocabulary is
    larger, as a real model's is than the prompts it sees); ``embedded``: the embedded default's model."""
    import torch
    from skip_plugin_arithmetic.task import ArithmeticOptions, ArithmeticTask
    from transformers import Qwen2Config, Qwen2ForCausalLM

    task = ArithmeticTask().prepare(directory / "task", ArithmeticOptions(warmup_steps=0), progress=False)
    if embedded:
        return Path(task.model_path)
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


def _family(pid: int) -> list[int]:
    """The process and its descendants (a vLLM engine's core and worker processes)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(p for child in children for p in _family(int(child)))]


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


class GroupSender:
    """Rank 0 of a gloo group (``skip_core.weight_group``), as the policy's rank 0 is."""

    def __init__(self, nbytes: int, world_size: int) -> None:
        import ray
        import torch
        from skip_core import weight_group

        self.flat = torch.ones(nbytes, dtype=torch.uint8)
        self.store = weight_group.host(ray.util.get_node_ip_address(), world_size, 600)

    def where(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), self.store.port

    def join(self, group) -> None:
        from skip_core import weight_group

        self.pg = weight_group.join(group, 0, self.store)

    def send(self) -> None:
        from skip_core import weight_group

        weight_group.send(self.pg, self.flat).wait()


class GroupReceiver:
    def __init__(self, nbytes: int) -> None:
        import torch

        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)  # resident, as an engine's weights are
        self.buffer.add_(0)

    def join(self, group, rank: int) -> None:
        from skip_core import weight_group

        self.pg = weight_group.join(group, rank)

    def receive(self) -> int:
        import torch.distributed as dist

        dist.broadcast(self.buffer, src=0, group=self.pg)
        return int(self.buffer[-1])


def raw(nbytes: int, rounds: int, workers: int, via: str, receiving: dict) -> dict:
    """The same bytes, with nothing of the trainer's or the engines': over the object store, one
    ``ray.put`` on node A, then each of ``workers`` receivers gets and copies it; over a gloo group,
    one broadcast from node A into each receiver's buffer."""
    import ray
    from skip_core.weight_group import WeightGroup

    if via == "group":
        sender = ray.remote(GroupSender).options(resources={"node_a": 0.01}).remote(nbytes, workers + 1)
        receivers = [ray.remote(GroupReceiver).options(**receiving).remote(nbytes) for _ in range(workers)]
        address, port = ray.get(sender.where.remote())
        group = WeightGroup(address, port, workers + 1, "gloo", "bench-raw")
        ray.get([sender.join.remote(group), *(r.join.remote(group, i + 1) for i, r in enumerate(receivers))])
    else:
        sender = ray.remote(Sender).options(resources={"node_a": 0.01}).remote(nbytes)
        receivers = [ray.remote(Receiver).options(**receiving).remote(nbytes) for _ in range(workers)]
    pids = [_pid(sender), *(_pid(r) for r in receivers)]
    times, extra, store = [], None, 0
    for _ in range(rounds):
        with Peak(pids) as peak, StorePeak() as stored:
            start = time.perf_counter()
            if via == "group":
                sent = sender.send.remote()
                assert ray.get([receiver.receive.remote() for receiver in receivers]) == [1] * workers
                ray.get(sent)
            else:
                refs = sender.put.remote()
                assert ray.get([receiver.get.remote(refs) for receiver in receivers]) == [1] * workers
            times.append(time.perf_counter() - start)
        extra, store = extra or peak.extra, max(store, stored.peak)
    for actor in (sender, *receivers):
        ray.kill(actor)
    return {"times": times, "sender": extra[pids[0]], "receivers": [extra[p] for p in pids[1:]], "store": store}


VLLM = (
    "rollout.backend=vllm",
    "rollout.engine_kwargs.vllm.enforce_eager=true",
    "rollout.engine_kwargs.vllm.dtype=float32",
    "rollout.engine_kwargs.vllm.max_model_len=512",
    "rollout.engine_kwargs.vllm.cpu_kvcache_space_gb=1",
)
SGLANG = ("rollout.backend=sglang", "rollout.engine_kwargs.sglang.dtype=float32")
ENGINES = {"hf": ("rollout.hf.device=cpu",), "vllm": VLLM, "sglang": SGLANG}


def _load_alone(worker, model: str, megabytes: float, version: int) -> float:
    """Seconds the worker's engine takes to load the model's weights from buckets already in its
    memory: the sync without the transfer."""
    from safetensors.torch import load_file
    from skip_plugin_trainer.rollout.weights import plan

    state = load_file(f"{model}/model.safetensors")
    buckets = plan(((name, t.nbytes) for name, t in state.items()), megabytes)
    start = time.perf_counter()
    for index, names in enumerate(buckets):
        worker.loop.load_weights_bucket({n: state[n] for n in names}, index, len(buckets), version, False)
    return time.perf_counter() - start


def bucketed(model: Path, workers: int, megabytes: float, rounds: int, backend: str, via: str, receiving: dict) -> dict:
    import ray
    from skip_plugin_trainer.commands import compose_config
    from skip_plugin_trainer.config.algorithm import ActorConfig
    from skip_plugin_trainer.config.settings import RolloutSettings
    from skip_plugin_trainer.rollout.group import RolloutGroup
    from skip_plugin_trainer.rollout.group_sync import GroupSync
    from skip_plugin_trainer.rollout.worker import RolloutWorker
    from skip_plugin_trainer.train.model_group import ModelGroup, WeightSource
    from skip_plugin_trainer.train.policy import Policy

    config = compose_config(None, "run", (f"model.path={model}", "task.name=null", *ENGINES[backend]))
    settings = RolloutSettings.from_config(config)
    actor = ray.remote(Policy).options(resources={"node_a": 0.01}, num_cpus=0)
    actor = actor.remote(str(model), ActorConfig(ppo_mini_batch_size=1), samples_per_prompt=1)
    remote = ray.remote(RolloutWorker).options(**receiving, num_cpus=0, max_concurrency=4)
    spawned = [remote.remote(settings, 1, rank) for rank in range(workers)]
    group = RolloutGroup(lambda: spawned, group_sync=GroupSync("gloo") if via == "group" else None)
    ray.get([w.__ray_ready__.remote() for w in [actor, *spawned]])
    ray.get(actor.__ray_call__.remote(lambda policy: _touch(policy.model)))
    if backend == "hf":  # an engine's weights are its own copy, resident once loaded
        ray.get([w.__ray_call__.remote(lambda worker: _touch(worker.loop.backend.model)) for w in spawned])
    source = WeightSource(ModelGroup([actor], mini_batch=1), megabytes, keep=False)
    if via == "group":  # formed before the rounds, as a run forms it once: its first sync
        start = time.perf_counter()
        group.update_weights(source, 0)
        formed = time.perf_counter() - start
    receivers = [_family(_pid(w)) for w in spawned]
    pids = [_pid(actor), *(pid for family in receivers for pid in family)]
    times, extra, store = [], None, 0
    for version in range(1, rounds + 1):
        with Peak(pids) as peak, StorePeak() as stored:
            start = time.perf_counter()
            group.update_weights(source, version)
            times.append(time.perf_counter() - start)
        extra, store = extra or peak.extra, max(store, stored.peak)
    alone = spawned[0].__ray_call__.remote
    loads = [ray.get(alone(_load_alone, str(model), megabytes, rounds + 1 + i)) for i in range(rounds)]
    group.shutdown()
    for a in [actor, *spawned]:
        ray.kill(a)
    return {
        "times": times,
        "sender": extra[pids[0]],
        "receivers": [sum(extra[p] for p in family) for family in receivers],
        "buckets": source.count,
        "store": store,
        "load alone": loads,
        **({"first sync": formed} if via == "group" else {}),
    }


def measure(args: argparse.Namespace) -> None:
    import ray
    from rich.console import Console
    from rich.table import Table
    from safetensors import safe_open

    ray.init(address=args.address, log_to_driver=False)
    with safe_open(str(Path(args.model_dir) / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
        shapes = {name: weights.get_slice(name).get_shape() for name in names}
    # The saved file holds one name per storage, as a sync sends them; the policy trains in float32.
    nbytes = sum(4 * math.prod(shape) for shape in shapes.values())
    params = nbytes // 4
    to = "node B" if args.nodes == 2 else "node A (one node)"
    table = Table(title=f"weight sync, {params / 1e6:.1f}M parameters ({nbytes / MB:.0f} MiB float32), node A -> {to}")
    for column in ("path", "workers", "buckets", "sync s (median)", "all rounds s", "x raw", "engine load alone s",
                   "first sync s", "object stores peak MiB", "sender extra RSS MiB",
                   "receiver extra RSS MiB (max)"):  # fmt: skip
        table.add_column(column, justify="right" if column != "path" else "left")
    receiving = {"resources": {"node_b" if args.nodes == 2 else "node_a": 0.01}}
    raw_path = "raw gloo broadcast" if args.via == "group" else "raw ray.put / ray.get"
    via = "a gloo group" if args.via == "group" else "the object store"
    for workers in args.workers:
        base = raw(nbytes, args.rounds, workers, args.via, receiving)
        result = bucketed(Path(args.model_dir), workers, args.bucket_mb, args.rounds, args.backend, args.via, receiving)
        raw_median = statistics.median(base["times"])
        for path, row in (
            (raw_path, base),
            (f"skip over {via}, {args.backend}, {args.bucket_mb:g} MiB buckets", result),
        ):
            median = statistics.median(row["times"])
            table.add_row(
                path,
                str(workers),
                str(row.get("buckets", "-")),
                f"{median:.2f}",
                " ".join(f"{t:.2f}" for t in row["times"]),
                f"{median / raw_median:.2f}",
                f"{statistics.median(row['load alone']):.2f}" if "load alone" in row else "-",
                f"{row['first sync']:.2f}" if "first sync" in row else "-",
                f"{row['store'] / MB:.0f}",
                f"{row['sender'] / MB:.0f}",
                f"{max(row['receivers']) / MB:.0f}",
            )
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--backend", choices=list(ENGINES), default="hf", help="the rollout workers' engine")
    parser.add_argument("--via", choices=["group", "object_store"], default="group", help="rollout.weight_sync's path")
    parser.add_argument("--nodes", type=int, choices=[1, 2], default=2, help="1: the engines on the trainer's node")
    parser.add_argument("--model", choices=["qwen2-0.5b", "embedded"], default="qwen2-0.5b", help="the model's shape")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick try (default: 24)")
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.address:  # inside the head's namespace
        measure(args)
        return
    why = namespaces_refused()
    if why is not None:
        sys.exit(f"two Ray nodes need a mount namespace each: {why}")
    with tempfile.TemporaryDirectory(prefix="skip-bench-sync-") as tmp:
        directory = Path(tmp)
        # vLLM's caches (else ~/.cache/vllm), for the nodes' workers, which inherit the environment.
        os.environ["VLLM_CACHE_ROOT"] = str(directory / "vllm-cache")
        if args.backend == "sglang":
            sglang_on_cpu()  # PYTHONPATH, which the nodes' workers inherit
        print("building the model ...", flush=True)
        model = build_model(directory, args.layers, embedded=args.model == "embedded")
        nodes = directory / "nodes"
        nodes.mkdir()
        with two_nodes(nodes, cpus=4, object_store_bytes=3 * 10**9, shm="4g") as (head, address):
            command = ["nsenter", f"--mount=/proc/{head}/ns/mnt", sys.executable, __file__, *sys.argv[1:],
                       "--address", address, "--model-dir", str(model)]  # fmt: skip
            subprocess.run(command, check=True, env=node_env(address))


if __name__ == "__main__":
    main()
