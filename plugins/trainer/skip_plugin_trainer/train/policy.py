"""The policy being trained: log-probs of rollouts, the PPO update, and its weights.

A plain class: ``workers.py`` hosts it in a Ray actor, tests drive it in-process. Batches
arrive in verl's layout (``input_ids`` = left-padded prompt ++ right-padded response); the
logits that predict the response are the ``response_length`` positions before the end.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from skip_core.backend import untied
from skip_core.batch import Batch

from skip_plugin_trainer.algorithm_settings import ActorConfig, RolloutCorrection
from skip_plugin_trainer.rollout.weights import Bucket, pack, plan
from skip_plugin_trainer.run_sections import ModelConfig
from skip_plugin_trainer.train import lora as peft_lora
from skip_plugin_trainer.train import lr_schedule
from skip_plugin_trainer.train.algorithm import (
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    log_probs_from_logits,
    policy_loss,
)
from skip_plugin_trainer.train.correction import bypass_policy_loss
from skip_plugin_trainer.train.located import Located


class Policy(Located):
    """The trained model, its optimizer, and (for KL) a frozen copy of the initial weights.

    With ``lora`` (``model.lora_rank`` > 0) the model carries peft adapters, the only weights
    trained, and the reference is the base model with the adapters off (``train/lora.py``).
    """

    def __init__(
        self,
        model_path: str,
        config: ActorConfig,
        *,
        samples_per_prompt: int,
        temperature: float = 1.0,
        use_reference: bool = False,
        seed: int = 0,
        threads: int | None = None,
        total_training_steps: int | None = None,
        lora: ModelConfig | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per weight file, in every worker's log
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.config = config
        self.samples_per_prompt = samples_per_prompt
        # Rollout log-probs are taken at the sampling temperature; greedy rollouts sample at 1.
        self.temperature = temperature or 1.0
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.lora = lora is not None and lora.lora_rank > 0
        if self.lora:
            self.model = peft_lora.with_adapters(self.model, lora)
        self.use_reference = use_reference
        self.reference = copy.deepcopy(self.model).requires_grad_(False) if use_reference and not self.lora else None
        optim = config.optim
        trained = [parameter for parameter in self.model.parameters() if parameter.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trained, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
        )
        # The run's steps: a cosine decay or a warm-up ratio of ``optim`` needs them.
        self.total_training_steps = total_training_steps
        self.lr_scheduler = lr_schedule.scheduler(self.optimizer, optim, total_training_steps)
        self._published: dict[str, torch.Tensor] = {}  # the weights being synced, by ``publish_weights``
        self._buckets: list[list[str]] = []

    # -- what the trainer calls --------------------------------------------------------

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch) -> Batch:
        """``old_log_probs`` and per-token ``entropys`` under the current weights."""
        micros = micro_batches(batch, self.config.ppo_micro_batch_size)
        parts = [self._forward(self.model, micro) for micro in micros]
        return Batch({"old_log_probs": torch.cat([p[0] for p in parts]), "entropys": torch.cat([p[1] for p in parts])})

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        if not self.use_reference:
            raise RuntimeError("the policy was built without a reference model (no KL is configured)")
        micros = micro_batches(batch, self.config.ppo_micro_batch_size)
        with peft_lora.base_only(self.model) if self.lora else contextlib.nullcontext(self.reference) as reference:
            parts = [self._forward(reference, micro, entropy=False)[0] for micro in micros]
        return Batch({"ref_log_prob": torch.cat(parts)})

    def update(self, batch: Batch) -> dict[str, float]:
        """``ppo_epochs`` passes of clipped-PPO steps, one optimizer step per mini-batch, at the lr
        the schedule gives this update (``actor/lr``); then the schedule moves on, once."""
        size = self.config.ppo_mini_batch_size * self.samples_per_prompt
        if len(batch) % size:
            raise ValueError(f"{len(batch)} samples do not split into mini-batches of {size}")
        metrics: dict[str, list[float]] = defaultdict(list)
        lr = self.optimizer.param_groups[0]["lr"]
        for _ in range(self.config.ppo_epochs):
            for mini in batch.chunk(len(batch) // size):
                self._step(mini, metrics)
        self.lr_scheduler.step()
        return {**{key: sum(values) / len(values) for key, values in metrics.items()}, "actor/lr": lr}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the weights, for a checkpoint (tied tensors appear under each name, as HF lists
        them); the rollout engines get theirs through ``publish_weights``."""
        return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}

    def publish_weights(self, megabytes: float, keep: bool) -> int:
        """Make the current weights the ones ``weight_bucket`` sends, in buckets of ``megabytes``;
        returns how many. ``keep`` snapshots them: an overlapped schedule trains on while they
        are sent, and a rollout worker restarted later must get these, not newer ones."""
        tensors = untied(peft_lora.merged_state_dict(self.model) if self.lora else self.model.state_dict())
        if keep and not self.lora:  # merged tensors are new ones already
            tensors = {name: tensor.detach().clone() for name, tensor in tensors.items()}
        self._published = tensors
        self._buckets = plan(((name, t.numel() * t.element_size()) for name, t in tensors.items()), megabytes)
        return len(self._buckets)

    def weight_bucket(self, index: int) -> Bucket:
        """Bucket ``index`` of the published weights, packed for the object store."""
        return pack({name: self._published[name] for name in self._buckets[index]})

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.state_dict(), self.optimizer.state_dict()

    def load_checkpoint_state(
        self, model: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any], *, updates: int
    ) -> None:
        """Weights and optimizer state of a checkpoint whose run had made ``updates`` updates: the lr
        schedule continues from there (``lr_schedule.scheduler``)."""
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        self.lr_scheduler = lr_schedule.scheduler(self.optimizer, self.config.optim, self.total_training_steps, updates)

    # -- internals ---------------------------------------------------------------------

    def _forward(self, model: Any, batch: Batch, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response log-probs (and entropies), right-padded to the response width."""
        width = batch.batch["responses"].shape[1]
        logits = response_outputs(model, batch).float() / self.temperature
        log_probs = pad_right(log_probs_from_logits(logits, batch.batch["responses"][:, : logits.shape[1]]), width)
        return log_probs, pad_right(entropy_from_logits(logits), width) if entropy else None

    def _step(self, mini: Batch, metrics: dict[str, list[float]]) -> None:
        cfg = self.config
        ppo = {
            "clip_ratio_low": cfg.clip_ratio_low,
            "clip_ratio_high": cfg.clip_ratio_high,
            "clip_ratio_c": cfg.clip_ratio_c,
            "loss_agg_mode": cfg.loss_agg_mode,
        }
        # Bypass mode (the phases send it): the old log-probs are the rollout's, and the loss
        # weighs and rejects tokens by how far the policy now is from them (verl's bypass loss).
        bypass: RolloutCorrection | None = mini.meta_info.get("rollout_correction")
        self.optimizer.zero_grad(set_to_none=True)
        for micro in micro_batches(mini, cfg.ppo_micro_batch_size):
            log_prob, entropy = self._forward(self.model, micro, entropy=cfg.entropy_coeff != 0)
            mask = micro.batch["response_mask"]
            old, advantages = micro.batch["old_log_probs"], micro.batch["advantages"]
            if bypass is None:
                weights = micro.batch.get("rollout_is_weights")  # decoupled mode's, when rollout_is is set
                result = policy_loss(old, log_prob, advantages, mask, weights=weights, **ppo)
            else:
                result, corrected = bypass_policy_loss(bypass, old, log_prob, advantages, mask, **ppo)
                for key, value in corrected.items():
                    metrics[key].append(value)
            loss = result.loss
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.loss_agg_mode)
            if cfg.use_kl_loss:
                per_token = kl_penalty(log_prob, micro.batch["ref_log_prob"], cfg.kl_loss_type)
                kl = agg_loss(per_token, mask, cfg.loss_agg_mode)
                loss = loss + cfg.kl_loss_coef * kl
                metrics["actor/kl_loss"].append(kl.item())
            (loss * len(micro) / len(mini)).backward()
            metrics["actor/pg_loss"].append(result.loss.item())
            if result.clipfrac is not None:  # reinforce clips nothing
                metrics["actor/pg_clipfrac"].append(result.clipfrac)
            metrics["actor/ppo_kl"].append(result.approx_kl)
        limit = cfg.grad_clip if cfg.grad_clip is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit).item()
        metrics["actor/grad_norm"].append(grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # one bad batch must not poison the weights; the metric shows it happened
            metrics["actor/skipped_steps"].append(1.0)


def micro_batches(batch: Batch, size: int) -> Iterator[Batch]:
    for start in range(0, len(batch), size):
        yield batch[start : start + size]


def response_outputs(model: Any, batch: Batch) -> torch.Tensor:
    """The model's outputs at the positions that predict each response token (``[batch, kept, ...]``,
    ``kept`` <= the response width: trailing all-padding columns are left out).

    Computed on the batch cut to its non-padding span: prompts are left-padded and responses
    right-padded to fixed widths, so most columns of a short batch are padding on every row;
    dropping them changes no result.
    """
    width = batch.batch["responses"].shape[1]
    total = batch.batch["input_ids"].shape[1]
    used = batch.batch["attention_mask"].bool().any(dim=0).nonzero().flatten()
    start, end = int(used[0]), max(int(used[-1]) + 1, total - width + 1)
    out = model(
        input_ids=batch.batch["input_ids"][:, start:end],
        attention_mask=batch.batch["attention_mask"][:, start:end],
        position_ids=batch.batch["position_ids"][:, start:end],
        use_cache=False,
    )
    kept = end - (total - width)  # response columns inside the span
    return out.logits[:, -kept - 1 : -1]


def pad_right(values: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))
