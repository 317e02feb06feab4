"""How a run's weight syncs reach the engines (``rollout.weight_sync``), and why.

Over a process group (``skip_core.weight_group``), the actor's first rank broadcasts each bucket,
cast to the engines' dtype, to every engine process at once: NCCL where the actor trains and the
engines generate on GPUs of their own, gloo otherwise (colocated, an actor rank and an engine
share a GPU, which NCCL refuses in one group: the buckets go through host memory). Through the
object store, each bucket goes into Ray's object store once per node and every engine reads it
from there: any engine takes it, it is the path of a worker that joins late or is restarted
between syncs, and on host memory it measured faster (docs/rollout.md gives what each costs). ``auto`` takes the group
where NCCL carries it (the actor and the engines on GPUs of their own) and the object store on
host memory, where its shared memory measured faster; it says why.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from skip_core.config import ConfigError

from skip_plugin_trainer.config.sections import Resources


class WeightSync(NamedTuple):
    via: Literal["group", "object_store"]
    backend: Literal["gloo", "nccl"] | None  # the group's
    reason: str

    def line(self) -> str:
        how = f"over a {self.backend} process group" if self.via == "group" else "through Ray's object store"
        return f"weight sync: {how} ({self.reason})"


def choose(asked: str, engine: str, device: str, resources: Resources) -> WeightSync:
    """The path ``rollout.weight_sync`` (``asked``) gives the engine ``rollout.backend`` names, the
    actor on ``device``, or a ConfigError naming the key where it cannot be had."""
    from skip_core.backend import find_backend

    key = f"rollout.weight_sync={asked}"
    if asked == "object_store":
        return WeightSync("object_store", None, key)
    on_gpus = device == "cuda"  # the actor; colocated, the engines share its GPUs
    if not find_backend(engine).joins_weight_group:
        why_not = f"the {engine} backend takes weights only through update_weights"
        if asked == "group":
            raise ConfigError(f"rollout.weight_sync: group is not possible: {why_not}; allowed: auto, object_store")
        return WeightSync("object_store", None, f"{key}: {why_not}")
    joined = f"{key}: the {engine} engines join it"
    if on_gpus and resources.rollout.gpus_per_worker > 0 and not resources.colocate:
        return WeightSync("group", "nccl", f"{joined}, the actor and the engines on GPUs of their own")
    # Host memory either way: on one node the object store is shared memory, which measured
    # faster than a gloo broadcast for hf and vLLM (docs/rollout.md#weight-sync).
    if on_gpus and resources.colocate:
        where = "colocated on GPUs, where NCCL refuses two ranks of one group on one GPU"
        if asked == "group":
            return WeightSync("group", "gloo", f"{joined}, {where}: through host memory")
        return WeightSync("object_store", None, f"{key}: {where}")
    if asked == "group":
        return WeightSync("group", "gloo", f"{joined}, the actor or the engines on CPUs")
    return WeightSync("object_store", None, f"{key}: the actor or the engines on CPUs, where it measured faster")
