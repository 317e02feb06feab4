"""The critic of GAE-PPO (verl's ``critic``): the policy's architecture with a one-output head,
estimating the return before each response token, trained on the clipped value loss.

A plain class like ``Policy``: ``workers.py`` hosts its ranks in Ray actors of their own beside
the policy's, tests drive it in-process.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from skip_core.batch import Batch

from skip_plugin_trainer.algorithms.aggregation import Totals, token_share
from skip_plugin_trainer.config.algorithm import CriticConfig
from skip_plugin_trainer.train.distributed import Group, join, shard, world
from skip_plugin_trainer.train.loading import pretrained
from skip_plugin_trainer.train.micro_batches import split
from skip_plugin_trainer.train.offload import resident
from skip_plugin_trainer.train.policy import pad_right, response_outputs
from skip_plugin_trainer.train.precision import Precision, attention, trainable
from skip_plugin_trainer.train.trained import TrainedModel, UpdateMetrics, on_device
from skip_plugin_trainer.train.value import value_loss


class Critic(TrainedModel):
    prefix = "critic"

    def __init__(
        self,
        model_path: str,
        config: CriticConfig,
        *,
        samples_per_prompt: int,
        seed: int = 0,
        threads: int | None = None,
        total_training_steps: int | None = None,
        group: Group | None = None,
        device: str = "cpu",
        attn_implementation: str | None = None,
        colocated: bool = False,
        config_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        from transformers import AutoModelForTokenClassification
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if threads:
            torch.set_num_threads(threads)
        self.precision = Precision.of(config.fsdp_config, device)
        kernel = attention(attn_implementation, device, self.precision.compute)
        sharded = group is not None and group.world > 1  # each rank reads only its shards
        if sharded:
            join(group, torch.device(device))
        sharding = functools.partial(shard, mixed=self.precision.sharding(), host=config.fsdp_config.offload_policy)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "newly initialized: score.weight" is the point: the head is new
        try:
            # no dropout (a value is a function of the tokens alone), checkpointing as configured
            self.model = pretrained(
                AutoModelForTokenClassification, model_path, self.precision.master, kernel, device,
                sharding if sharded else None, num_labels=1, **(config_overrides or {}),
                prepare=functools.partial(trainable, checkpointing=config.enable_gradient_checkpointing),
                fresh=functools.partial(value_head, seed=seed),
            )  # fmt: skip
        finally:
            hf_logging.set_verbosity(verbosity)
        self._setup(
            config, samples_per_prompt, total_training_steps, group, device, sharded=sharded, colocated=colocated
        )

    @torch.no_grad()
    @resident
    def compute_values(self, batch: Batch) -> Batch:
        """``values``: the estimate before each response token, 0 off the response mask."""
        micros = split(batch, self.config.ppo_micro_batch_size, self.config.values_budget())
        values = torch.cat([self._values(on_device(micro, self.device)) for micro in micros.micros])
        return Batch({"values": micros.restore(values).cpu()})

    def _values(self, batch: Batch) -> torch.Tensor:
        width = batch.batch["responses"].shape[1]
        with self.precision.autocast(self.device, sharded=world() > 1):
            outputs = response_outputs(self.model, batch)
        values = pad_right(outputs[..., 0].float(), width)
        return values * batch.batch["response_mask"]

    def _step(self, mini: Batch, totals: Totals, metrics: UpdateMetrics) -> None:
        cfg, parts = self.config, metrics.parts[-1]

        def loss(micro: Batch) -> torch.Tensor:
            mask = micro.batch["response_mask"]
            vpreds = self._values(micro)
            result = value_loss(
                vpreds, micro.batch["returns"], micro.batch["values"], mask, cfg.cliprange_value, cfg.loss_agg_mode,
                totals,
            )  # fmt: skip
            parts["critic/vf_loss"] += result.loss.item()
            parts["critic/vf_clipfrac"] += result.clipfrac
            parts["critic/vpred_mean"] += token_share(vpreds.detach(), mask, totals)
            return result.loss

        metrics.means["critic/grad_norm"].append(self._micro_batches(mini, loss))


def value_head(model: Any, seed: int) -> dict[str, torch.Tensor]:
    """The new value head's initial weights as transformers draws a linear layer's (normal with the
    config's ``initializer_range``, the bias zero), from ``seed`` alone and whole: a sharded
    critic, built on meta, starts from the same head as one rank."""
    generator = torch.Generator().manual_seed(seed)
    head = {"score.weight": torch.empty(model.score.weight.shape)}
    head["score.weight"].normal_(0.0, getattr(model.config, "initializer_range", 0.02), generator=generator)
    if model.score.bias is not None:
        head["score.bias"] = torch.zeros(model.score.bias.shape)
    return head
