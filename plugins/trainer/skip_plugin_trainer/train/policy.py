"""The policy being trained: log-probs of rollouts, the PPO update, and its weights.

A plain class: ``workers.py`` hosts its ranks in Ray actors, tests drive it in-process. Batches
arrive in verl's layout (``input_ids`` = left-padded prompt ++ right-padded response); the
logits that predict the response are the ``response_length`` positions before the end.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import torch
from skip_core.backend import logprob_temperature
from skip_core.batch import Batch
from skip_core.weight_group import Layout, WeightGroup

from skip_plugin_trainer.algorithms.aggregation import Totals, agg_loss
from skip_plugin_trainer.algorithms.contract import LossContext, LossInputs, policy_loss
from skip_plugin_trainer.algorithms.correction import bypass_mode
from skip_plugin_trainer.algorithms.distillation import combined, distillation_loss
from skip_plugin_trainer.algorithms.kl import kl_penalty
from skip_plugin_trainer.config.algorithm import ActorConfig, RolloutCorrection
from skip_plugin_trainer.config.distillation import DistillationConfig
from skip_plugin_trainer.config.sections import ModelConfig
from skip_plugin_trainer.rollout.weights import Bucket
from skip_plugin_trainer.train import lora as peft_lora
from skip_plugin_trainer.train.distributed import Group, full, join, own_state, shard, world
from skip_plugin_trainer.train.loading import pretrained
from skip_plugin_trainer.train.logits import token_log_probs
from skip_plugin_trainer.train.micro_batches import split
from skip_plugin_trainer.train.offload import Offload, resident
from skip_plugin_trainer.train.precision import Precision, attention, trainable
from skip_plugin_trainer.train.published import Published, WeightSender
from skip_plugin_trainer.train.trained import TrainedModel, UpdateMetrics, on_device


class Policy(TrainedModel):
    """The trained model, its optimizer, and (for KL) a frozen copy of the initial weights.

    With ``lora`` (``model.lora_rank`` > 0) the model carries peft adapters, the only weights
    trained, and the reference is the base model with the adapters off (``train/lora.py``).
    With ``group``, one rank of the sharded policy (``train/distributed.py``). It trains in
    ``actor.fsdp_config``'s precision, checkpointing per ``model`` (``train/precision.py``);
    the reference is held in the compute dtype, in eval mode.
    """

    prefix = "actor"

    def __init__(
        self,
        model_path: str,
        config: ActorConfig,
        *,
        samples_per_prompt: int,
        temperature: float = 1.0,
        use_reference: bool = False,
        teacher: DistillationConfig | None = None,
        seed: int = 0,
        threads: int | None = None,
        total_training_steps: int | None = None,
        model_config: ModelConfig | None = None,
        group: Group | None = None,
        device: str = "cpu",
        colocated: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per weight file, in every worker's log
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.temperature = logprob_temperature(temperature)  # the rollout's log-probs
        self._policy_loss = policy_loss(config.policy_loss.loss_mode)
        model_config = model_config or ModelConfig()
        self.precision = precision = Precision.of(config.fsdp_config, device)
        kernel = attention(model_config.attn_implementation, device, precision.compute)
        self.lora = model_config.lora_rank > 0
        self.use_reference = use_reference
        sharded = group is not None and group.world > 1  # each rank reads only its shards
        if sharded:
            join(group, torch.device(device))
        host = config.fsdp_config.offload_policy
        sharding = functools.partial(shard, mixed=precision.sharding(), host=host) if sharded else None

        def train_mode(model: Any) -> Any:  # before sharding: FSDP2 wraps the adapters with their layers
            model = trainable(model, model_config.enable_gradient_checkpointing)
            return peft_lora.with_adapters(model, model_config) if self.lora else model

        # the adapters are drawn from the seed, alike on any number of ranks; the files hold the base
        lora = {"fresh": functools.partial(peft_lora.initial_adapters, seed=seed), "stored": peft_lora.base_name}
        self.model = pretrained(
            AutoModelForCausalLM, model_path, precision.master, kernel, device, sharding, prepare=train_mode,
            **(lora if self.lora else {}), **model_config.override_config,
        )  # fmt: skip
        reference = None
        if use_reference and not self.lora:  # held in the compute dtype
            if sharded:
                reference = pretrained(
                    AutoModelForCausalLM, model_path, precision.compute, kernel, device, shard,
                    **model_config.override_config,
                )  # fmt: skip
            else:
                reference = copy.deepcopy(self.model).to(precision.compute)
            reference = reference.requires_grad_(False).eval()
        self._setup(
            config, samples_per_prompt, total_training_steps, group, device, sharded=sharded, colocated=colocated
        )
        if reference is not None and not sharded:
            reference = shard(reference.to(self.device))
        self.reference = reference
        self.reference_offload = Offload(self.device, weights=config.ref_param_offload or colocated, optimizer=False)
        if self.reference is not None:
            self.reference_offload.park(self.reference, None)
        # verl's on-policy distillation: the teacher, frozen in the compute dtype, parked as the reference is
        self.distillation = teacher if teacher is not None and teacher.enabled else None
        self.teacher = None
        if self.distillation is not None:
            self.teacher = pretrained(
                AutoModelForCausalLM, self.distillation.teacher_path, precision.compute, kernel, device,
                shard if sharded else None,
            ).requires_grad_(False).eval()  # fmt: skip
            if not sharded:
                self.teacher = shard(self.teacher.to(self.device))
            self.reference_offload.park(self.teacher, None)
        self._published = Published({}, 1)  # the weights being synced, by ``publish_weights``
        self._sender: WeightSender | None = None  # rank 0's place in the weight group

    # -- what the trainer calls --------------------------------------------------------

    @torch.no_grad()
    @resident
    def compute_log_prob(self, batch: Batch) -> Batch:
        """``old_log_probs`` and per-token ``entropys`` under the current weights, and with
        ``actor.calculate_sum_pi_squared`` the per-token ``sum_pi_squared``."""
        micros = split(batch, self.config.ppo_micro_batch_size, self.config.log_prob_budget())
        squares = self.config.calculate_sum_pi_squared
        parts = [self._forward(self.model, micro, sum_pi_squared=squares) for micro in micros.micros]
        names = ("old_log_probs", "entropys", "sum_pi_squared")[: len(parts[0])]
        return Batch(
            {name: micros.restore(torch.cat([part[i] for part in parts])).cpu() for i, name in enumerate(names)}
        )

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        if not self.use_reference:
            raise RuntimeError("the policy was built without a reference model (no KL is configured)")
        micros = split(batch, self.config.ppo_micro_batch_size, self.config.log_prob_budget(reference=True))
        if self.lora:
            with self.offload.loaded(self.model, None), peft_lora.base_only(self.model) as reference:
                parts = [self._forward(reference, micro, entropy=False)[0] for micro in micros.micros]
        else:
            with self.reference_offload.loaded(self.reference, None):
                parts = [self._forward(self.reference, micro, entropy=False)[0] for micro in micros.micros]
        return Batch({"ref_log_prob": micros.restore(torch.cat(parts)).cpu()})

    @torch.no_grad()
    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """The responses' log-probs under the distillation teacher, at the rollout temperature."""
        if self.teacher is None:
            raise RuntimeError("the policy was built without a teacher (distillation.enabled is false)")
        micros = split(batch, self.config.ppo_micro_batch_size, self.config.log_prob_budget(reference=True))
        with self.reference_offload.loaded(self.teacher, None):
            parts = [self._forward(self.teacher, micro, entropy=False)[0] for micro in micros.micros]
        return Batch({"teacher_log_prob": micros.restore(torch.cat(parts)).cpu()})

    @resident
    def publish_weights(self, megabytes: float, keep: bool) -> list[Layout]:
        """Make the current weights the ones a sync sends, in buckets of ``megabytes``; returns
        their layouts. ``keep`` snapshots them (each rank its shards): an overlapped schedule
        trains on while they are sent, and a rollout worker restarted later must get these."""
        tensors = peft_lora.merged_state_dict(self.model) if self.lora else own_state(self.model)
        if keep and not self.lora:  # merged tensors are new ones already
            tensors = {name: tensor.detach().clone() for name, tensor in tensors.items()}
        self._published = Published(tensors, megabytes)
        return self._published.layouts()

    @resident
    def weight_bucket(self, index: int) -> Bucket | None:
        """Bucket ``index`` of the published weights, packed for the object store by rank 0."""
        return self._published.bucket(index, self.rank == 0)

    def host_weight_group(self, world_size: int, timeout_s: float) -> tuple[str, int] | None:
        """Rank 0 hosts a new weight group (leaving the one before): where it meets."""
        if self.rank != 0:
            return None
        if self._sender is not None:
            self._sender.leave()
        self._sender = WeightSender(world_size, timeout_s, self.device)
        return self._sender.address, self._sender.store.port

    def join_weight_group(self, group: WeightGroup) -> None:
        if self._sender is not None:
            self._sender.join(group)

    @resident
    def send_weights(self, dtype: str) -> None:
        """The published weights over the weight group, in ``dtype``: every rank gathers, rank 0 broadcasts."""
        if self.rank == 0 and (self._sender is None or self._sender.group is None):
            raise RuntimeError("send_weights: the actor's rank 0 is in no weight group")
        self._published.send(self._sender if self.rank == 0 else None, dtype)

    @resident
    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the weights (tied tensors under each name, as HF lists them; gathered when sharded)."""
        return {name: full(tensor).detach().cpu().clone() for name, tensor in self.model.state_dict().items()}

    # -- internals ---------------------------------------------------------------------

    def _forward(self, model: Any, batch: Batch, entropy: bool = True, sum_pi_squared: bool = False) -> tuple:
        """Response log-probs and entropies (None without ``entropy``), and with ``sum_pi_squared``
        each token's sum of squared probabilities, right-padded to the response width."""
        batch = on_device(batch, self.device)
        width = batch.batch["responses"].shape[1]
        with self.precision.autocast(self.device, sharded=world() > 1):
            logits = response_outputs(model, batch)
        outputs = token_log_probs(
            logits,
            batch.batch["responses"][:, : logits.shape[1]],
            temperature=self.temperature,
            entropy=entropy,
            chunk=self.config.chunk,
            recompute=self.config.entropy_checkpointing,
            sum_pi_squared=sum_pi_squared,
        )
        return tuple(pad_right(output, width) if output is not None else None for output in outputs)

    def _step(self, mini: Batch, totals: Totals, metrics: UpdateMetrics) -> None:
        cfg = self.config
        # Bypass mode (the phases send it): the old log-probs are the rollout's, and the loss
        # weighs and rejects tokens by how far the policy now is from them (verl's bypass loss,
        # which replaces actor.policy_loss.loss_mode as verl's trainer does).
        correction: RolloutCorrection | None = mini.meta_info.get("rollout_correction")
        loss_of = bypass_mode if correction is not None else self._policy_loss
        parts = metrics.parts[-1]

        def loss(micro: Batch) -> torch.Tensor:
            log_prob, entropy = self._forward(self.model, micro, entropy=cfg.entropy_coeff != 0)
            mask = micro.batch["response_mask"]
            inputs = LossInputs(
                micro.batch["old_log_probs"], log_prob, micro.batch["advantages"], mask,
                weights=micro.batch.get("rollout_is_weights"),  # decoupled mode's, when rollout_is is set
            )  # fmt: skip
            context = LossContext(cfg, totals, mask, correction)
            result = loss_of(inputs, context)
            total = result.loss
            if cfg.entropy_coeff:
                total = total - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.loss_agg_mode, totals)
            if cfg.use_kl_loss:
                per_token = kl_penalty(log_prob, micro.batch["ref_log_prob"], cfg.kl_loss_type)
                kl = agg_loss(per_token, mask, cfg.loss_agg_mode, totals)
                total = total + cfg.kl_loss_coef * kl
                parts["actor/kl_loss"] += kl.item()
            parts["actor/pg_loss"] += result.loss.item()
            for key, value in result.metrics.items():
                if key.startswith("actor/"):  # parts of the mini-batch's value
                    parts[key] += value
                else:  # the rollout correction's, a value per micro-batch
                    metrics.means[key].append(value)
            if self.distillation is not None:
                loss = self.distillation.distillation_loss
                distilled = distillation_loss(inputs, micro.batch["teacher_log_prob"], context, loss)
                total = combined(total, distilled.loss, loss)
                parts["distillation/loss"] += distilled.loss.item()
                for key, value in distilled.metrics.items():
                    parts[key] += value
            return total

        grad_norm = self._micro_batches(mini, loss)
        metrics.means["actor/grad_norm"].append(grad_norm)
        if not math.isfinite(grad_norm):  # the metric shows a step was skipped
            metrics.means["actor/skipped_steps"].append(1.0)


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
