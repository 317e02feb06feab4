"""What the policy and the critic share: a model on its device and sharded over its group, its
optimizer and lr schedule, PPO's pass over mini-batches, and its state in a checkpoint.

A rank trains its share of every mini-batch (the driver's ``ModelGroup`` cuts them). Each
micro-batch's loss is its part of the whole mini-batch's (``Totals``: the mini-batch's tokens and
rows, over every rank), so the gradients FSDP averages over the ranks, scaled by their number,
add up to the gradient of the whole mini-batch, however it was split. The metrics come back the
same way (``UpdateMetrics``): parts that add up to each mini-batch's value, and values to average.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from skip_core.batch import Batch

from skip_plugin_trainer.actors import Located
from skip_plugin_trainer.algorithms.aggregation import Totals
from skip_plugin_trainer.train import lr_schedule, shards
from skip_plugin_trainer.train.distributed import Group, as_float, join, rank, shard, world
from skip_plugin_trainer.train.micro_batches import split
from skip_plugin_trainer.train.offload import Offload, resident
from skip_plugin_trainer.train.precision import Precision


@dataclass
class UpdateMetrics:
    """One rank's metrics of an update: ``parts[k]`` are its shares of optimizer step ``k``'s
    values (they add up over micro-batches and ranks), ``means`` are values to average."""

    parts: list[dict[str, float]] = field(default_factory=list)
    means: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    @staticmethod
    def reduce(ranks: list[UpdateMetrics]) -> dict[str, float]:
        """The update's metrics: each step's parts summed over the ranks, then every value
        averaged over the steps."""
        values: dict[str, list[float]] = defaultdict(list)
        for index in range(len(ranks[0].parts)):
            for key in ranks[0].parts[index]:
                values[key].append(sum(r.parts[index][key] for r in ranks))
        for r in ranks:
            for key, items in r.means.items():
                values[key].extend(items)
        return {key: sum(items) / len(items) for key, items in values.items() if items}


class TrainedModel(Located):
    """A subclass builds ``self.model`` in ``self.precision`` and calls ``_setup``; it implements ``_step``."""

    prefix = "model"  # of its metrics: ``actor/lr``, ``critic/grad_norm``
    precision: Precision

    def _setup(
        self,
        config: Any,
        samples_per_prompt: int,
        total_training_steps: int | None,
        group: Group | None,
        device: str,
        sharded: bool = False,
        colocated: bool = False,
    ) -> None:
        """Join the group, move the model to ``device`` and shard it (in ``self.precision``; not
        when it was built ``sharded``), and build the optimizer over what trains (after sharding:
        it holds the shards). ``colocated``: the weights and optimizer state go to the host between
        calls whatever the offload keys say, as verl's hybrid engine moves them (the engine that
        shares the GPU generates meanwhile)."""
        self.config, self.samples_per_prompt = config, samples_per_prompt
        self.device = torch.device(device)
        join(group, self.device)
        fsdp = config.fsdp_config
        if not sharded:
            self.model = shard(self.model.to(self.device), self.precision.sharding(), host=fsdp.offload_policy)
        optim = config.optim
        trained = [parameter for parameter in self.model.parameters() if parameter.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trained, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
        )
        self.total_training_steps = total_training_steps  # the span of a cosine decay or a warm-up ratio
        self.lr_scheduler = lr_schedule.scheduler(self.optimizer, optim, total_training_steps)
        # FSDP2's offload keeps the shards on the host already: nothing is left to move
        weights, optimizer = fsdp.param_offload or colocated, fsdp.optimizer_offload or colocated
        self.offload = Offload(self.device, weights and not fsdp.offload_policy, optimizer)
        self.offload.park(self.model, self.optimizer)

    def update(self, batch: Batch) -> dict[str, float]:
        """``ppo_epochs`` passes of optimizer steps over the mini-batches of ``batch`` (all of them,
        on a single rank) at the lr the schedule gives this update (``<prefix>/lr``)."""
        return UpdateMetrics.reduce([self.update_share(batch)])

    @resident
    def update_share(self, batch: Batch) -> UpdateMetrics:
        """This rank's share of an update: its share of each mini-batch, in order; the
        mini-batches' ``totals`` come with the batch (``ModelGroup``), or are its own."""
        size = self.config.ppo_mini_batch_size * self.samples_per_prompt // world()
        if len(batch) % size:
            raise ValueError(f"{len(batch)} samples do not split into mini-batch shares of {size}")
        minis = batch.chunk(len(batch) // size)
        totals = batch.meta_info.get("totals") or [Totals.of(mini.batch["response_mask"]) for mini in minis]
        metrics = UpdateMetrics()
        metrics.means[f"{self.prefix}/lr"].append(self.optimizer.param_groups[0]["lr"])
        for _ in range(self.config.ppo_epochs):
            for mini, total in zip(minis, totals, strict=True):
                metrics.parts.append(defaultdict(float))
                self._step(mini, total, metrics)
        self.lr_scheduler.step()
        return metrics

    def _step(self, mini: Batch, totals: Totals, metrics: UpdateMetrics) -> None:
        raise NotImplementedError

    def _micro_batches(self, mini: Batch, loss: Callable[[Batch], torch.Tensor]) -> float:
        """Accumulate the gradient of ``mini``'s loss, one micro-batch's part at a time (``loss``
        of a micro-batch on the device), then one optimizer step unless the gradient is not
        finite (one bad batch must not poison the weights); returns the gradient's norm."""
        self.optimizer.zero_grad(set_to_none=True)
        budget = self.config.ppo_max_token_len_per_gpu if self.config.use_dynamic_bsz else None
        for micro in split(mini, self.config.ppo_micro_batch_size, budget).micros:
            (loss(on_device(micro, self.device)) * world()).backward()  # FSDP averages over the ranks
        limit = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        grad_norm = as_float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        return grad_norm

    # -- checkpoints ----------------------------------------------------------------------

    @resident
    def save_shards(self, directory: str) -> dict[str, Any]:
        """Write this rank's shards of the weights and optimizer state (``shards.save``)."""
        return shards.save(self.model, self.optimizer, Path(directory))

    @resident
    def load_shards(self, directory: str, saved: dict[str, Any], *, updates: int) -> None:
        """Read the state ``save_shards`` wrote, with any number of ranks; the lr schedule
        continues after ``updates`` updates (``lr_schedule.scheduler``)."""
        shards.load(self.model, self.optimizer, Path(directory), saved)
        self.lr_scheduler = lr_schedule.scheduler(self.optimizer, self.config.optim, self.total_training_steps, updates)

    @resident
    def load_full_state(self, model: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any], *, updates: int) -> None:
        """Weights and optimizer state as one process saved them (checkpoints of format 1)."""
        if world() > 1:
            raise RuntimeError("a checkpoint of format 1 loads into a single rank")
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        self.lr_scheduler = lr_schedule.scheduler(self.optimizer, self.config.optim, self.total_training_steps, updates)

    @property
    def rank(self) -> int:
        return rank()


def on_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` with its tensors on ``device`` (the same batch when they are there)."""
    if all(tensor.device == device for tensor in batch.batch.values()):
        return batch
    moved = {key: tensor.to(device, non_blocking=True) for key, tensor in batch.batch.items()}
    return Batch(moved, batch.non_tensor_batch, batch.meta_info)
