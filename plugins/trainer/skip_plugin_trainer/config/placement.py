"""Where a run's workers go: the bundles it asks Ray for, and on a GPU run which actor rank and
which engine (and the engine's tensor-parallel rank) each GPU holds.

Separate pools (the default): the rollout pool's bundles hold one engine each, with the engine's
GPUs (``resources.rollout.gpus_per_worker``, its tensor-parallel size), and the actor pool's one
rank each (the critic's rank beside it). Colocated (``resources.colocate`` with GPUs): verl's
hybrid engine. Every GPU is one bundle holding one actor rank and the engine, or the engine's
tensor-parallel shard, that shares it; N GPUs give N ranks and N/TP engines, and each engine's
bundles are one placement group packed on one node (its shards talk over that node's links).
Two ranks of one NCCL group never share a GPU: NCCL refuses it ("Duplicate GPU detected").
On the CPU nothing is placed on a device, and colocation only puts the engines to sleep while
the actor trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skip_core.config import ConfigError


@dataclass(frozen=True)
class Bundle:
    """One bundle of the run's GPUs: ``gpus`` of them, the actor rank and the engine on them
    (``shard``: the engine's tensor-parallel rank when the bundle holds one GPU of several)."""

    gpus: float
    rank: int | None
    engine: int | None
    shard: int | None = None


@dataclass(frozen=True)
class Placement:
    """The bundles that hold GPUs, in the order Ray is asked for them (none on a CPU run);
    ``tp``: the GPUs one engine spans; ``hybrid``: each bundle is one GPU that an actor rank and
    an engine (or one shard of it) share."""

    bundles: tuple[Bundle, ...]
    tp: int
    hybrid: bool

    def lines(self) -> list[str]:
        """The placement as a table, one line per bundle (none on a CPU run)."""
        if not self.bundles:
            return []
        title = "colocated, one actor rank and one engine shard per GPU" if self.hybrid else "separate pools"
        lines = [f"placement ({title}; tensor parallel {self.tp}):", "  bundle  GPUs  actor rank  engine  TP rank"]
        for index, bundle in enumerate(self.bundles):
            shard = bundle.shard if bundle.shard is not None else ("all" if bundle.engine is not None else None)
            cells = (_cell(bundle.rank), _cell(bundle.engine), _cell(shard))
            lines.append(f"  {index:>6}  {bundle.gpus:>4g}  {cells[0]:>10}  {cells[1]:>6}  {cells[2]:>7}")
        return lines


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def plan(resources: Any, tp: int, device: str) -> Placement:
    """The placement of ``resources`` (the ``resources`` section) for engines of ``tp`` GPUs and
    an actor training on ``device``; ``ConfigError`` naming the key where the numbers cannot
    give every rank a GPU of its own or every engine its ``tp`` GPUs."""
    rollout, actor = resources.rollout, resources.actor
    if device != "cuda":
        return Placement((), tp, hybrid=False)
    if resources.colocate:
        if actor.gpus_per_worker != 1:
            raise ConfigError(
                f"resources.actor.gpus_per_worker: colocated, each actor rank has one GPU, shared with its engine "
                f"(not {actor.gpus_per_worker:g}); set 1"
            )
        if rollout.gpus_per_worker not in (0, tp):
            raise ConfigError(
                f"resources.rollout.gpus_per_worker: colocated, an engine spans its tensor-parallel size, {tp} "
                f"GPUs of the actor's (not {rollout.gpus_per_worker:g}); set {tp} or leave it 0"
            )
        if actor.workers % tp or rollout.workers != actor.workers // tp:
            engines = f"{actor.workers // tp}" if actor.workers % tp == 0 else "no whole number of"
            raise ConfigError(
                f"resources.rollout.workers: colocated, {actor.workers} GPUs (resources.actor.workers) hold "
                f"{engines} engines of tensor parallel {tp}, not {rollout.workers}"
            )
        return Placement(tuple(Bundle(1, rank, rank // tp, rank % tp) for rank in range(actor.workers)), tp, True)
    if tp > 1 and rollout.gpus_per_worker != tp:
        raise ConfigError(
            f"resources.rollout.gpus_per_worker: an engine of tensor parallel {tp} needs {tp} GPUs "
            f"(not {rollout.gpus_per_worker:g})"
        )
    if actor.workers > 1 and 0 < actor.gpus_per_worker < 1:
        raise ConfigError(
            f"resources.actor.gpus_per_worker: {actor.gpus_per_worker:g} puts two of the {actor.workers} actor "
            "ranks on one GPU, which NCCL refuses; set 1, or resources.colocate=true to share GPUs with the engines"
        )
    engines = [Bundle(rollout.gpus_per_worker, None, engine) for engine in range(rollout.workers)]
    ranks = [Bundle(actor.gpus_per_worker, rank, None) for rank in range(actor.workers)]
    return Placement(tuple(bundle for bundle in engines + ranks if bundle.gpus), tp, hybrid=False)
