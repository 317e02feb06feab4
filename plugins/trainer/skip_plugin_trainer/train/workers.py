"""The run's Ray side: Ray itself, and the rollout workers and the policy worker, each in its resource pool.

A pool is a Ray placement group of one bundle per worker, so a run either gets all the
resources it was configured with or fails at start, naming the key to change. Nothing here
assumes one machine: with ``RAY_ADDRESS`` set, the bundles land wherever the cluster has room.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from skip_core.config import ConfigError

from skip_plugin_trainer.actors import settle
from skip_plugin_trainer.config.settings import RunSettings
from skip_plugin_trainer.rollout.group import RolloutGroup
from skip_plugin_trainer.rollout.group_sync import GroupSync
from skip_plugin_trainer.rollout.worker import RolloutWorker
from skip_plugin_trainer.train.critic import Critic
from skip_plugin_trainer.train.distributed import Group, free_address
from skip_plugin_trainer.train.model_group import ModelGroup, WeightSource
from skip_plugin_trainer.train.policy import Policy

POOL_TIMEOUT_S = 60
STREAMED_PER_WORKER = 256
Placed = tuple["Pool", dict[str, Any]]  # a pool, and what each of its workers asks of its bundle


def quiet_local_ray() -> None:
    """A new local Ray turns token authentication on (RAY_AUTH_MODE unset) and warns that it did,
    at every start, with nothing for the user to do: that logger keeps only its errors."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


class Cluster:
    """The run's Ray side: Ray itself (joined, or started locally), the rollout and actor pools,
    and the workers placed in them. Each pool joins ``pools`` as soon as it is placed, so
    ``close`` frees whatever a failed start had placed."""

    def __init__(self) -> None:
        self.pools: list[Pool] = []
        self.rollout: RolloutGroup | None = None
        self.actor: ModelGroup | None = None
        self.critic: ModelGroup | None = None
        self.weights: WeightSource | None = None
        self._where: dict[str, tuple[str, Any]] = {}

    def start(self, settings: RunSettings, overlapped: bool, total_steps: int, defer_rollout: bool = False) -> None:
        """Place the pools and start the workers; with ``defer_rollout`` (train-only) the rollout
        pool is placed (its resources held for later) but its workers start on first use.
        ``total_steps``, the run's training steps, is what the lr schedules span."""
        resources = settings.resources
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            # Ray starts workers at nice 15 to keep its driver responsive; here the workers do all
            # the run's work, and at 15 beside any other busy process they get a sliver of a CPU.
            local = {"num_cpus": resources.num_cpus, "_system_config": {"worker_niceness": 0}}
            if not address:
                quiet_local_ray()
            ray.init(**({"address": address} if address else local), include_dashboard=False, log_to_driver=True)
        # The critic's ranks share the policy's bundles, as verl colocates them: a step runs their phases in turn.
        share = 2 if settings.use_critic else 1
        (rollout, engines), (actor, ranks) = self._place(settings, share)
        threads = resources.threads(rollout.spec.cpus, overlapped, together=resources.rollout.workers)
        # Many concurrent calls per worker: streamed samples each wait in one; the engine batches them.
        restarts = resources.rollout.max_restarts
        spawn = functools.partial(
            rollout.spawn, RolloutWorker, settings, threads, concurrency=STREAMED_PER_WORKER, restarts=restarts,
            **engines,
        )  # fmt: skip
        timeout = resources.rollout.restart_timeout_s
        sync = settings.weight_sync()
        group_sync = GroupSync(sync.backend) if sync.via == "group" else None
        self.rollout = RolloutGroup(spawn, started=not defer_rollout, restart_timeout_s=timeout, group_sync=group_sync)
        actor_pool = resources.actor
        threads = resources.threads(actor.spec.cpus, overlapped, together=actor_pool.workers)
        common = {"seed": settings.trainer.seed, "threads": threads, "total_training_steps": total_steps}
        common |= {"samples_per_prompt": settings.rollout.n, "device": settings.device}
        common |= {"colocated": settings.resources.colocate}
        self.actor = ModelGroup(
            actor.spawn(
                Policy,
                str(settings.model_path()),
                settings.actor,
                each=actor.ranks(),
                temperature=settings.rollout.temperature,
                **ranks,
                use_reference=settings.use_reference,
                teacher=settings.distillation,
                model_config=settings.model,
                **common,
            ),
            settings.actor.ppo_mini_batch_size * settings.rollout.n,
        )
        if settings.use_critic:
            path, critic = str(settings.model_path()), settings.critic
            common["attn_implementation"] = settings.model.attn_implementation
            common["config_overrides"] = settings.model.override_config
            workers = actor.spawn(Critic, path, critic, each=actor.ranks(), **ranks, **common)
            self.critic = ModelGroup(workers, critic.ppo_mini_batch_size * settings.rollout.n)
        # Both pools load their models side by side; the first step's timing is then the step's.
        settle([worker.__ray_ready__.remote() for pool in self.pools for worker in pool.actors], "starting the workers")
        self.weights = WeightSource(self.actor, settings.rollout.update_weights_bucket_megabytes, keep=overlapped)
        named = [("actor", self.actor), ("critic", self.critic)]
        self._where = {
            a._actor_id.hex(): (f"the {name} worker" + (f" of rank {rank}" if len(group) > 1 else ""), a.where.remote())
            for name, group in named
            if group is not None
            for rank, a in enumerate(group.ranks)
        }

    def _place(self, settings: RunSettings, share: int) -> tuple[Placed, Placed]:
        """The rollout pool and the actor pool placed (``settings.placement()``), each with what its
        workers ask of their bundles (``Pool.spawn``'s options); colocated on GPUs, one pool for
        both: an engine in the first bundle of its GPUs, each actor rank (and critic rank) in its
        own, a third of the GPU each (half without a critic)."""
        rollout, actor, placement = settings.resources.rollout, settings.resources.actor, settings.placement()
        if not placement.hybrid:
            engines = (rollout.workers, rollout.cpus_per_worker, rollout.gpus_per_worker, rollout.ray_resources or {})
            ranks = (actor.workers, actor.cpus / actor.workers, actor.gpus_per_worker, actor.ray_resources or {})
            specs = [PoolSpec("rollout", *engines), PoolSpec("actor", *ranks)]
            Pool.check_capacity(specs)
            for spec in specs:  # each joins ``pools`` once placed: ``close`` frees it if the next fails
                self.pools.append(Pool(spec))
            return (self.pools[0], {"each": lambda index: {"rank": index}}), (self.pools[1], {"share": share})
        tp, cpus = placement.tp, actor.cpus / actor.workers
        holds = ": colocated, each GPU's bundle holds its engine's share of resources.rollout.cpus_per_worker too"
        spec = PoolSpec(
            "actor", actor.workers, cpus + rollout.cpus_per_worker / tp, 1, actor.ray_resources or {}, holds
        )
        Pool.check_capacity([spec])
        pool = Pool(spec)
        self.pools.append(pool)
        devices = pool.devices() if tp > 1 else None  # an engine's shards are its worker's processes, on these GPUs
        nodes = ray.util.placement_group_table(pool.group)["bundles_to_node_id"]
        for first in range(0, actor.workers, tp):
            if len({nodes[index] for index in range(first, first + tp)}) > 1:
                raise ConfigError(
                    f"resources.actor.workers: engine {first // tp}'s {tp} GPUs were placed on more than one node; "
                    f"an engine's shards need one node (tensor parallel {tp} at most the GPUs of a node)"
                )

        def engine(index: int) -> dict[str, Any]:
            return {"rank": index // tp, "devices": ",".join(devices[index : index + tp]) if devices else None}

        gpus = 1 / (share + 1)
        engines = {"bundles": range(0, actor.workers, tp), "cpus": rollout.cpus_per_worker / tp, "gpus": gpus}
        return (pool, {"each": engine, **engines}), (pool, {"cpus": cpus / share, "gpus": gpus})

    def describe(self, lost: RayActorError) -> str:
        """Which of the run's workers ``lost`` is about, and where it ran: ``the actor worker (pid 12
        on node 10.0.0.2) died: <Ray's reason>`` (``the actor worker of rank 1`` when sharded)."""
        name, where = self._where.get(lost.actor_id or "", ("a worker", None))
        try:
            where = ray.get(where, timeout=1) if where is not None else "?"
        except (RayActorError, GetTimeoutError):
            where = "?"
        return f"{name} ({where}) died: {str(lost).splitlines()[0].rstrip('.')}"

    def close(self) -> None:
        """Let the rollout workers stop their engines and write their profiles, then free the pools."""
        if self.rollout is not None and self.pools:
            try:
                self.rollout.shutdown()
            except Exception as exc:  # a worker that already died; the pools still free the rest
                warnings.warn(f"rollout workers did not shut down cleanly: {exc!r}", RuntimeWarning, stacklevel=2)
        for pool in self.pools:
            pool.close()
        self.pools.clear()


@dataclass(frozen=True)
class PoolSpec:
    """What a pool asks of the cluster: ``bundles`` of ``cpus`` CPUs and ``gpus`` GPUs plus the
    ``ray_resources`` of ``resources.<name>`` (custom resources a node offers, e.g.
    ``{node_b: 1}``: the pool goes to the nodes that have them)."""

    name: str
    bundles: int
    cpus: float
    gpus: float
    ray_resources: Mapping[str, float]
    holds: str = ""  # what a bundle holds besides the pool's own workers, for the message

    @property
    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {}), **self.ray_resources}

    def unplaceable(self) -> str:
        cluster = ray.cluster_resources()
        if self.gpus and not cluster.get("GPU"):
            return (
                f"resources.{self.name}.gpus_per_worker: the {self.name} pool asks for {self.gpus:g} GPU per "
                f"worker, and the Ray cluster has none ({_listed(cluster)})"
            )
        asked = " + ".join(f"{v:g} {k}" for k, v in self.bundle.items())
        return (
            f"resources.{self.name}: the {self.name} pool needs {self.bundles} x ({asked}{self.holds}), which the "
            f"Ray cluster ({_listed(cluster)}) cannot place next to the other pools"
        )


def _listed(resources: Mapping[str, float]) -> str:
    """What a cluster offers a pool: CPUs, GPUs and custom resources (not its nodes or memory)."""
    hidden = ("node:", "memory", "object_store_memory", "accelerator_type:")
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items()) if not k.startswith(hidden)) or "nothing"


class Pool:
    """A placement group and the actors placed in its bundles."""

    def __init__(self, spec: PoolSpec) -> None:
        self.name, self.spec = spec.name, spec
        self.group: PlacementGroup = placement_group([spec.bundle] * spec.bundles, strategy="PACK", name=spec.name)
        ready, _ = ray.wait([self.group.ready()], timeout=POOL_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.group)
            raise ConfigError(spec.unplaceable())
        self.actors: list[Any] = []

    @staticmethod
    def check_capacity(pools: Sequence[PoolSpec]) -> None:
        """Fail at once when the pools need more of a resource than the whole cluster has,
        instead of waiting for a placement that can never happen."""
        have = ray.cluster_resources()
        for resource in {name for pool in pools for name in pool.bundle}:
            if sum(pool.bundles * pool.bundle.get(resource, 0) for pool in pools) > have.get(resource, 0):
                raise ConfigError([pool for pool in pools if resource in pool.bundle][-1].unplaceable())

    def ranks(self) -> Callable[[int], dict[str, Any]]:
        """Each bundle's ``group`` argument: its rank in a torch.distributed group of one rank per
        bundle, which meets at a free port of bundle 0's node (none for a single bundle)."""
        world = self.group.bundle_count
        if world == 1:
            return lambda rank: {"group": None}
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=0)
        address = ray.get(ray.remote(free_address).options(num_cpus=0, scheduling_strategy=strategy).remote())
        return lambda rank: {"group": Group(rank, world, address)}

    def spawn(
        self,
        cls: type,
        *args: Any,
        each: Callable[[int], dict[str, Any]] | None = None,
        concurrency: int = 1,
        share: int = 1,
        restarts: int = 0,
        bundles: Sequence[int] | None = None,
        cpus: float | None = None,
        gpus: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """One ``cls`` actor per bundle (of ``bundles``; all by default), its constructor started
        (``__ray_ready__`` says when it is done) with ``each(bundle index)`` added to its keyword
        arguments; ``concurrency`` calls may run in one actor at a time (threads); ``share``
        actors will share each bundle's CPUs and GPUs, unless ``cpus`` and ``gpus`` say what each
        asks; Ray restarts one that dies ``restarts`` times (its calls then fail: the caller
        redoes them). Returns the new actors, in bundle order."""
        remote = ray.remote(cls)
        new = []
        for index in range(self.group.bundle_count) if bundles is None else bundles:
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
            actor = remote.options(
                num_cpus=self.spec.cpus / share if cpus is None else cpus,
                num_gpus=self.spec.gpus / share if gpus is None else gpus,
                scheduling_strategy=strategy,
                name=None,
                max_concurrency=concurrency,
                max_restarts=restarts,
                max_task_retries=0,
            )
            new.append(actor.remote(*args, **kwargs, **(each(index) if each else {})))
        self.actors.extend(new)
        return new

    def devices(self) -> list[str]:
        """The GPU id each bundle holds (Ray's, as ``CUDA_VISIBLE_DEVICES`` names it), asked of a
        task placed in it; a bundle without GPUs gives ``""``."""
        probes = []
        for index in range(self.group.bundle_count):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
            options = {"num_cpus": 0, "num_gpus": 1e-4 if self.spec.gpus else 0, "scheduling_strategy": strategy}
            probes.append(ray.remote(_gpu_ids).options(**options).remote())
        return ray.get(probes)

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.group)


def _gpu_ids() -> str:
    return ",".join(str(gpu) for gpu in ray.get_gpu_ids())
