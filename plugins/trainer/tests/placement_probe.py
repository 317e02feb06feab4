"""The run's real placement (``Cluster._place``, ``Pool.spawn``) on a Ray that declares 8 GPUs on
this CPU machine: a stand-in worker in each place a rollout worker and an actor rank would go
reports the GPU ids Ray gave it and the ``devices`` it was handed. Printed as one JSON line after
``MARK`` (Ray's own warnings share the output).
Run by ``test_placement.py``: ``python placement_probe.py '<overrides as JSON>'``."""

from __future__ import annotations

import json
import sys

MARK = "placed: "


class Where:
    """Stands in for ``RolloutWorker``, ``Policy`` and ``Critic``: takes their arguments, keeps
    what placement decides."""

    def __init__(self, *args, rank: int | None = None, devices: str | None = None, group=None, **kwargs) -> None:
        self.rank, self.devices = rank if group is None else group.rank, devices

    def report(self) -> dict:
        import ray

        return {"rank": self.rank, "gpus": [str(gpu) for gpu in ray.get_gpu_ids()], "devices": self.devices}


def main() -> None:
    import ray
    from skip_plugin_trainer.config.settings import RunSettings
    from skip_plugin_trainer.train.workers import Cluster

    overrides = json.loads(sys.argv[1])
    settings = RunSettings.from_config(_tree(overrides))
    ray.init(num_cpus=4, num_gpus=8, include_dashboard=False, log_to_driver=False)
    cluster = Cluster()
    try:
        share = 2 if settings.use_critic else 1
        (rollout, engines), (actor, ranks) = cluster._place(settings, share)
        placed = {
            "engines": rollout.spawn(Where, **engines),
            "ranks": actor.spawn(Where, each=actor.ranks(), **ranks),
        }
        if share == 2:
            placed["critic"] = actor.spawn(Where, each=actor.ranks(), **ranks)
        reports = {name: ray.get([w.report.remote() for w in workers]) for name, workers in placed.items()}
        print(MARK + json.dumps(reports), flush=True)
    finally:
        cluster.close()
        ray.shutdown()


def _tree(overrides: dict) -> dict:
    """``{"a.b": 1}`` as ``{"a": {"b": 1}}``."""
    tree: dict = {}
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


if __name__ == "__main__":
    main()
