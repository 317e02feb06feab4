"""The critic of GAE-PPO (verl's ``critic``): the policy's architecture with a one-output head,
estimating the return before each response token, trained on the clipped value loss.

A plain class like ``Policy``: ``workers.py`` hosts it in a Ray actor of its own beside the
policy, tests drive it in-process.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from skip_core.batch import Batch

from skip_plugin_trainer.algorithm_settings import CriticConfig
from skip_plugin_trainer.train import lr_schedule
from skip_plugin_trainer.train.algorithm import masked_mean
from skip_plugin_trainer.train.located import Located
from skip_plugin_trainer.train.policy import micro_batches, pad_right, response_outputs
from skip_plugin_trainer.train.value import value_loss


class Critic(Located):
    def __init__(
        self,
        model_path: str,
        config: CriticConfig,
        *,
        samples_per_prompt: int,
        seed: int = 0,
        threads: int | None = None,
        total_training_steps: int | None = None,
    ) -> None:
        from transformers import AutoModelForTokenClassification
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)  # the new head's initial weights
        self.config, self.samples_per_prompt = config, samples_per_prompt
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "newly initialized: score.weight" is the point: the head is new
        try:
            model = AutoModelForTokenClassification.from_pretrained(model_path, num_labels=1, dtype=torch.float32)
        finally:
            hf_logging.set_verbosity(verbosity)
        self.model = model.eval()  # no dropout: a value is a function of the tokens alone
        optim = config.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
        )
        self.total_training_steps = total_training_steps
        self.lr_scheduler = lr_schedule.scheduler(self.optimizer, optim, total_training_steps)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """``values``: the estimate before each response token, 0 off the response mask."""
        micros = micro_batches(batch, self.config.ppo_micro_batch_size)
        return Batch({"values": torch.cat([self._values(micro) for micro in micros])})

    def update(self, batch: Batch) -> dict[str, float]:
        """``ppo_epochs`` passes over mini-batches toward ``returns``, one optimizer step each, at the
        lr the schedule gives this update (``critic/lr``); then the schedule moves on, once."""
        cfg = self.config
        size = cfg.ppo_mini_batch_size * self.samples_per_prompt
        if len(batch) % size:
            raise ValueError(f"{len(batch)} samples do not split into mini-batches of {size}")
        metrics: dict[str, list[float]] = defaultdict(list)
        lr = self.optimizer.param_groups[0]["lr"]
        for _ in range(cfg.ppo_epochs):
            for mini in batch.chunk(len(batch) // size):
                self._step(mini, metrics)
        self.lr_scheduler.step()
        return {**{key: sum(values) / len(values) for key, values in metrics.items()}, "critic/lr": lr}

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        model = {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}
        return model, self.optimizer.state_dict()

    def load_checkpoint_state(
        self, model: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any], *, updates: int
    ) -> None:
        """As ``Policy.load_checkpoint_state``: the lr schedule continues after ``updates`` updates."""
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        self.lr_scheduler = lr_schedule.scheduler(self.optimizer, self.config.optim, self.total_training_steps, updates)

    def _values(self, batch: Batch) -> torch.Tensor:
        width = batch.batch["responses"].shape[1]
        values = pad_right(response_outputs(self.model, batch)[..., 0].float(), width)
        return values * batch.batch["response_mask"]

    def _step(self, mini: Batch, metrics: dict[str, list[float]]) -> None:
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        for micro in micro_batches(mini, cfg.ppo_micro_batch_size):
            mask = micro.batch["response_mask"]
            vpreds = self._values(micro)
            result = value_loss(
                vpreds, micro.batch["returns"], micro.batch["values"], mask, cfg.cliprange_value, cfg.loss_agg_mode
            )
            (result.loss * len(micro) / len(mini)).backward()
            metrics["critic/vf_loss"].append(result.loss.item())
            metrics["critic/vf_clipfrac"].append(result.clipfrac)
            metrics["critic/vpred_mean"].append(masked_mean(vpreds.detach(), mask).item())
        limit = cfg.grad_clip if cfg.grad_clip is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit).item()
        metrics["critic/grad_norm"].append(grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
