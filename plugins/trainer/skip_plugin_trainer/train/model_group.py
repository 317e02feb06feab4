"""The driver's handle on a trained model's ranks (the policy's or the critic's), seen as one model.

A batch is cut into each rank's share and the results joined in order; an update's batch is cut
mini-batch by mini-batch, each rank getting its share of every one and the mini-batch's
``Totals``, so the sharded update is the unsharded one (``trained.py``). The ranks run
collectives inside their calls, which meet only if every rank gets the same calls in the same
order: calls go to all ranks at once, under a lock, whichever thread of a schedule makes them.
A rank that dies fails the call at once (its peers would wait in a collective until the
run's pools are freed), as a ``RayActorError`` naming it.

``WeightSource`` is the policy group's side of a weight sync, the buckets the rollout workers load.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from skip_core.batch import Batch
from skip_core.weight_group import Layout

from skip_plugin_trainer.actors import settle
from skip_plugin_trainer.algorithms.aggregation import Totals
from skip_plugin_trainer.train.trained import UpdateMetrics


class ModelGroup:
    """``ranks``: the Ray actors of one model's ranks, in rank order; ``mini_batch``: the samples
    of one of its mini-batches (``ppo_mini_batch_size`` x ``rollout.n``)."""

    def __init__(self, ranks: Sequence[Any], mini_batch: int) -> None:
        self.ranks, self.mini_batch = list(ranks), mini_batch
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.ranks)

    def submit(self, method: str, *args: Any, shares: Sequence[Any] | None = None, **kwargs: Any) -> list[Any]:
        """``method`` on every rank (with ``shares[rank]`` first, when given): their object refs."""
        with self._lock:
            return [
                getattr(actor, method).remote(*([shares[rank]] if shares is not None else []), *args, **kwargs)
                for rank, actor in enumerate(self.ranks)
            ]

    def call(self, method: str, *args: Any, shares: Sequence[Any] | None = None, **kwargs: Any) -> list[Any]:
        """``submit`` and wait: every rank's result, in rank order."""
        return settle(self.submit(method, *args, shares=shares, **kwargs))

    def per_sample(self, method: str, batch: Batch) -> Batch:
        """A per-sample ``method`` (log-probs, values): each rank its share, joined in order."""
        return Batch.concat(self.call(method, shares=batch.chunk(len(self.ranks))))

    def compute_log_prob(self, batch: Batch) -> Batch:
        return self.per_sample("compute_log_prob", batch)

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return self.per_sample("compute_ref_log_prob", batch)

    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        return self.per_sample("compute_teacher_log_prob", batch)

    def compute_values(self, batch: Batch) -> Batch:
        return self.per_sample("compute_values", batch)

    def update(self, batch: Batch) -> dict[str, float]:
        """One update on ``batch``: each rank gets its share of every mini-batch, in order."""
        return UpdateMetrics.reduce(self.call("update_share", shares=update_shares(batch, self.mini_batch, len(self))))


def update_shares(batch: Batch, mini_batch: int, ranks: int) -> list[Batch]:
    """Each of ``ranks``' share of every mini-batch of ``mini_batch`` samples, in order, with the
    mini-batches' ``Totals`` (a loss divides by the whole mini-batch's)."""
    if len(batch) % mini_batch:
        raise ValueError(f"{len(batch)} samples do not split into mini-batches of {mini_batch}")
    minis = batch.chunk(len(batch) // mini_batch)
    totals = [Totals.of(mini.batch["response_mask"]) for mini in minis]
    cut = [mini.chunk(ranks) for mini in minis]
    shares = [Batch.concat([pieces[rank] for pieces in cut]) for rank in range(ranks)]
    for share in shares:
        share.meta_info = {**batch.meta_info, "totals": totals}
    return shares


class WeightSource:
    """The actor's weights of the last sync, as buckets of ``megabytes`` (``keep``: snapshotted,
    for a schedule that trains while they are sent). ``actor`` is its ``ModelGroup``: every rank
    gathers each bucket's tensors, rank 0 hands them over."""

    def __init__(self, actor: ModelGroup, megabytes: float, keep: bool) -> None:
        self.actor, self.megabytes, self.keep = actor, megabytes, keep
        self.version = 0
        self.layouts: list[Layout] = []  # each bucket's tensors

    @property
    def count(self) -> int:
        return len(self.layouts)

    def publish(self, version: int) -> None:
        self.layouts = self.actor.call("publish_weights", self.megabytes, self.keep)[0]
        self.version = version

    def buckets(self) -> Iterator[tuple[int, Any]]:
        """Each bucket's object ref, the next one asked of the actor before this one is used."""
        ahead = self.actor.submit("weight_bucket", 0) if self.count else None
        for index in range(self.count):
            refs = ahead
            ahead = self.actor.submit("weight_bucket", index + 1) if index + 1 < self.count else None
            settle(refs[1:])  # a rank lost while gathering fails the sync here, not in a rollout worker
            yield index, refs[0]
