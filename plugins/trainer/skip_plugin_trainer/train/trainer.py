"""The main job: a GRPO run on Ray whose phases a schedule puts in order (``skip run``).

``Trainer`` checks every setting and input before it starts anything (a bad key fails in a
second, not after the model loaded), then owns the workers, the data position, checkpoints
and metrics. Each phase of verl's step (generate, reward, old log-probs, reference
log-probs, advantages, update, weight sync, validation) is one method; a ``Schedule``
decides their order, so the same trainer runs colocated (``sync``) or overlapped schedules.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import ray
import torch
from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, NonNegativeFloat, NonNegativeInt, PositiveInt, field_validator
from rich.console import Console
from skip_core import spans
from skip_core.batch import Batch
from skip_core.config import ConfigError, lookup, parse_section, select, to_container
from skip_core.manager import SkipManager
from skip_core.schedule import Schedule

from skip_plugin_trainer.data import PromptLoader, RLDataset, collate
from skip_plugin_trainer.rollout.agent_loop import LoopConfig
from skip_plugin_trainer.rollout.job import RolloutParts, load_tokenizer, loop_config, model_path, prepare_task
from skip_plugin_trainer.train.algorithm import agg_loss, apply_kl_penalty, compute_advantages
from skip_plugin_trainer.train.checkpoint import CheckpointManager, capture_rng, restore_rng
from skip_plugin_trainer.train.metrics import Tracking, check_backends, data_metrics, plot, summary_table
from skip_plugin_trainer.train.policy import ActorConfig, Policy
from skip_plugin_trainer.train.reward import RewardConfig, Rewarder
from skip_plugin_trainer.train.workers import Pool, Resources, RolloutGroup, RolloutWorker

# What the rollout workers need of a prompt batch; the rest stays with the trainer.
GEN_TENSORS = ("input_ids", "attention_mask", "position_ids")
GEN_NON_TENSORS = ("raw_prompt_ids", "raw_prompt", "tools_kwargs")
# What the policy worker reads; nothing else crosses to it.
ACTOR_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


class AlgorithmConfig(BaseModel):
    """``algorithm``: the advantage estimator and the optional KL penalty in the reward."""

    model_config = ConfigDict(extra="forbid")
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = "grpo"
    gamma: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"] = "kl"
    kl_coef: NonNegativeFloat = 0.001


class TrainerConfig(BaseModel):
    """``trainer``: length of the run, its directory, checkpoints, validation and loggers."""

    model_config = ConfigDict(extra="forbid")
    project_name: str = "skip"
    experiment_name: str = "run"
    schedule: str = "sync"
    total_epochs: PositiveInt = 1
    total_training_steps: PositiveInt | None = None
    default_local_dir: str = "runs/train"
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = False
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None
    max_ckpt_to_keep: PositiveInt | None = None
    logger: list[str] = ["console", "jsonl"]
    seed: NonNegativeInt = 0

    @field_validator("logger")
    @classmethod
    def _loggers_available(cls, value: list[str]) -> list[str]:
        check_backends(value)
        return value


@dataclass(frozen=True)
class Settings:
    """Every section the run reads, validated and cross-checked before any work."""

    rollout: LoopConfig
    actor: ActorConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    resources: Resources
    reward: RewardConfig
    train_batch_size: int

    @classmethod
    def from_config(cls, config: Any) -> Settings:
        sections = {
            name: parse_section(model, name, select(config, name))
            for name, model in (
                ("actor", ActorConfig),
                ("algorithm", AlgorithmConfig),
                ("trainer", TrainerConfig),
                ("resources", Resources),
                ("reward", RewardConfig),
            )
        }
        batch = select(config, "data.train_batch_size")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ConfigError(f"data.train_batch_size: expected an integer > 0, got {batch!r}")
        settings = cls(rollout=loop_config(config), train_batch_size=batch, **sections)
        settings.check_sizes()
        return settings

    def check_sizes(self) -> None:
        actor, n = self.actor, self.rollout.n
        if self.train_batch_size % actor.ppo_mini_batch_size:
            raise ConfigError(
                f"actor.ppo_mini_batch_size: {actor.ppo_mini_batch_size} prompts do not divide "
                f"data.train_batch_size={self.train_batch_size}"
            )
        if (actor.ppo_mini_batch_size * n) % actor.ppo_micro_batch_size:
            raise ConfigError(
                f"actor.ppo_micro_batch_size: {actor.ppo_micro_batch_size} samples do not divide a mini-batch of "
                f"{actor.ppo_mini_batch_size} prompts x rollout.n={n} = {actor.ppo_mini_batch_size * n} samples"
            )
        workers = self.resources.rollout.workers
        if self.train_batch_size % workers:
            raise ConfigError(
                f"resources.rollout.workers: {workers} workers cannot split data.train_batch_size="
                f"{self.train_batch_size} prompts evenly"
            )
        if self.trainer.resume_mode == "resume_path" and not self.trainer.resume_from_path:
            raise ConfigError("trainer.resume_from_path: required with trainer.resume_mode=resume_path")

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward


class Trainer:
    def __init__(self, config: Any, console: Console) -> None:
        from skip_core.plugins import registry

        self.config, self.console = config, console
        self.settings = s = Settings.from_config(config)
        self.schedule: Schedule = lookup("trainer.schedule", "schedule", s.trainer.schedule, registry().schedules)(
            config
        )
        self.parts = RolloutParts.from_config(config)
        SkipManager.init(config)
        prepare_task(config)
        self.tokenizer = load_tokenizer(config)
        self.model_path = str(model_path(config))
        self.loader, self.val_set = self._data()
        self.rewarder = Rewarder(s.reward, self.tokenizer)
        self.rewarder.check_sources({row["data_source"] for row in self.loader.dataset}, "data.train_files")
        if self.val_set is not None:
            self.rewarder.check_sources({row["data_source"] for row in self.val_set}, "data.val_files")
            if len(self.val_set) % s.resources.rollout.workers:
                raise ConfigError(
                    f"resources.rollout.workers: {s.resources.rollout.workers} workers cannot split the "
                    f"{len(self.val_set)} validation prompts of data.val_files evenly"
                )
        steps_per_epoch = len(self.loader)
        self.total_steps = s.trainer.total_training_steps or steps_per_epoch * s.trainer.total_epochs
        self.run_dir = Path(os.path.expanduser(s.trainer.default_local_dir))
        self.checkpoints = CheckpointManager(self.run_dir, keep=s.trainer.max_ckpt_to_keep)
        self.global_steps = 0
        self.pools: list[Pool] = []
        self.tracking: Tracking | None = None
        self.rollout: RolloutGroup | None = None
        spans.configure(config, worker=-1)

    def _data(self) -> tuple[PromptLoader, RLDataset | None]:
        schemas = {name: tool.schema for name, tool in self.parts.tools.items()}
        data = select(self.config, "data")
        train = RLDataset(select(self.config, "data.train_files"), self.tokenizer, data, schemas)
        shuffle = select(self.config, "data.shuffle")
        loader = PromptLoader(
            train,
            batch_size=self.settings.train_batch_size,
            shuffle=True if shuffle is None else bool(shuffle),
            seed=select(self.config, "data.seed") or 0,
        )
        val_files = select(self.config, "data.val_files")
        val = None
        if val_files and self.settings.trainer.test_freq > 0:
            val = RLDataset(val_files, self.tokenizer, data, schemas, files_key="data.val_files")
        return loader, val

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Join or start Ray, place the pools, load the model and restore the last checkpoint."""
        s = self.settings
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            options = {"address": address} if address else {"num_cpus": s.resources.num_cpus}
            ray.init(**options, include_dashboard=False, log_to_driver=True)
        resolved = OmegaConf.to_container(self.config, resolve=True) if OmegaConf.is_config(self.config) else None
        rollout = Pool("rollout", "resources.rollout", s.resources.rollout.workers, s.resources.rollout.cpus_per_worker)
        self.pools.append(rollout)
        actor = Pool("actor", "resources.actor", 1, s.resources.actor.cpus)
        self.pools.append(actor)
        self.rollout = RolloutGroup(
            rollout.spawn(
                RolloutWorker, resolved or to_container(self.config), s.resources.threads(rollout.cpus), Pool.RANK
            )
        )
        (self.actor,) = actor.spawn(
            Policy,
            self.model_path,
            s.actor,
            samples_per_prompt=s.rollout.n,
            temperature=s.rollout.temperature,
            use_reference=s.use_reference,
            seed=s.trainer.seed,
            threads=s.resources.threads(actor.cpus),
        )
        self._resume()
        self.tracking = Tracking(
            s.trainer.logger,
            self.run_dir,
            resolved,
            project=s.trainer.project_name,
            experiment=s.trainer.experiment_name,
            console=self.console,
            resume_step=self.global_steps,
        )

    def close(self) -> None:
        """Wait for cache dumps, stop the workers and free the pools; safe after a failed start."""
        SkipManager.flush()
        if self.tracking is not None:
            self.tracking.close()
        self._stop_rollout()
        for pool in self.pools:
            pool.close()
        self.pools.clear()
        spans.close()

    def _stop_rollout(self) -> None:
        """Let the rollout workers stop their engines and write their profiles before the pool kills them."""
        if self.rollout is None or not self.pools:  # never started, or already closed
            return
        try:
            self.rollout.shutdown()
        except Exception as exc:  # a worker that already died; the pool still frees the rest
            warnings.warn(f"rollout workers did not shut down cleanly: {exc!r}", RuntimeWarning, stacklevel=2)

    def fit(self) -> None:
        self.schedule.fit(self)

    # -- checkpoints -------------------------------------------------------------------

    def _resume(self) -> None:
        mode = self.settings.trainer.resume_mode
        if mode == "disable":
            return
        if mode == "resume_path":
            path = Path(self.settings.trainer.resume_from_path)
            checkpoint = CheckpointManager(path.parent).load(_step_of(path))
        else:
            checkpoint = self.checkpoints.latest()
        if checkpoint is None:
            return
        self.loader.load_state_dict(checkpoint.trainer["loader"])
        ray.get(self.actor.load_checkpoint_state.remote(checkpoint.model, checkpoint.optimizer))
        self.sync_weights()
        restore_rng(checkpoint.rng)
        self.global_steps = int(checkpoint.trainer["global_steps"])
        self.console.print(f"resumed at step {self.global_steps} from {checkpoint.path}")

    def save_checkpoint(self) -> Path:
        model, optimizer = ray.get(self.actor.checkpoint_state.remote())
        state = {"global_steps": self.global_steps, "loader": self.loader.state_dict()}
        return self.checkpoints.save(self.global_steps, model, optimizer, state, capture_rng())

    def due(self, every: int) -> bool:
        """Whether a ``*_freq`` event falls on this step (the last step always counts)."""
        return every > 0 and (self.global_steps % every == 0 or self.global_steps == self.total_steps)

    # -- the phases of a step ----------------------------------------------------------

    def next_batch(self) -> Batch:
        """The step's prompts: reading, chat templates and tokenization happen here (``data`` span)."""
        with spans.span("trainer/data"):
            return next(self.loader)

    def generate(self, batch: Batch, step: int) -> Batch:
        """Roll out the prompts and return them joined with their samples (verl's pop, repeat, union)."""
        gen_batch = batch.pop(GEN_TENSORS, [k for k in GEN_NON_TENSORS if k in batch.non_tensor_batch])
        gen_batch.meta_info["global_steps"] = step
        output = self.rollout.generate_sequences(gen_batch)
        batch.non_tensor_batch["uid"] = np.array([f"{step}:{i}" for i in range(len(batch))], dtype=object)
        return batch.repeat(self.settings.rollout.n, interleave=True).union(output)

    def compute_reward(self, batch: Batch) -> None:
        scores, parts = self.rewarder(batch)
        batch.batch["token_level_scores"] = scores
        batch.non_tensor_batch.update(parts)

    def compute_old_log_prob(self, batch: Batch) -> dict[str, float]:
        out = ray.get(self.actor.compute_log_prob.remote(batch.select(ACTOR_INPUTS, [], [])))
        batch.batch["old_log_probs"] = out.batch["old_log_probs"]
        mask = batch.batch["response_mask"]
        metrics = {"actor/entropy": agg_loss(out.batch["entropys"], mask, self.settings.actor.loss_agg_mode).item()}
        if "rollout_log_probs" in batch.batch and mask.any():
            # How far the engine's log-probs are from the trainer's: a mismatch bias in the ratio.
            diff = (batch.batch["rollout_log_probs"].exp() - out.batch["old_log_probs"].exp()).abs()[mask.bool()]
            metrics["training/rollout_probs_diff_max"] = diff.max().item()
            metrics["training/rollout_probs_diff_mean"] = diff.mean().item()
        return metrics

    def compute_ref_log_prob(self, batch: Batch) -> None:
        out = ray.get(self.actor.compute_ref_log_prob.remote(batch.select(ACTOR_INPUTS, [], [])))
        batch.batch["ref_log_prob"] = out.batch["ref_log_prob"]

    def compute_advantage(self, batch: Batch) -> dict[str, float]:
        algo, metrics = self.settings.algorithm, {}
        scores, mask = batch.batch["token_level_scores"], batch.batch["response_mask"]
        if algo.use_kl_in_reward:
            rewards, kl = apply_kl_penalty(
                scores, mask, batch.batch["old_log_probs"], batch.batch["ref_log_prob"],
                coef=algo.kl_coef, mode=algo.kl_penalty,
            )  # fmt: skip
            batch.batch["token_level_rewards"] = rewards
            metrics = {"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": algo.kl_coef}
        else:
            batch.batch["token_level_rewards"] = scores
        advantages, returns = compute_advantages(
            algo.adv_estimator,
            batch.batch["token_level_rewards"],
            mask,
            batch.non_tensor_batch["uid"],
            gamma=algo.gamma,
            norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        )
        batch.batch["advantages"], batch.batch["returns"] = advantages, returns
        return metrics

    def update_actor(self, batch: Batch) -> dict[str, float]:
        keys = [*ACTOR_INPUTS, "old_log_probs", "advantages"]
        if self.settings.actor.use_kl_loss:
            keys.append("ref_log_prob")
        return ray.get(self.actor.update.remote(batch.select(keys, [], [])))

    def sync_weights(self) -> None:
        self.rollout.update_weights(self.actor.state_dict.remote())

    def validate(self) -> dict[str, float]:
        """Greedy (``rollout.val_kwargs``) rollouts of the validation set; skip roles let them through."""
        batch = collate([self.val_set[i] for i in range(len(self.val_set))])
        gen_batch = batch.pop(GEN_TENSORS, [k for k in GEN_NON_TENSORS if k in batch.non_tensor_batch])
        gen_batch.meta_info.update(global_steps=self.global_steps, validate=True)
        with spans.span("trainer/validate", step=self.global_steps, phase="val"):
            output = self.rollout.generate_sequences(gen_batch)
        batch = batch.repeat(self.settings.rollout.val_kwargs.n, interleave=True).union(output)
        _, parts = self.rewarder(batch)
        metrics = {"val/score/mean": float(parts["score"].mean())}
        sources = batch.non_tensor_batch["data_source"]
        for source in sorted(set(sources)):
            metrics[f"val/{source}/score/mean"] = float(parts["score"][sources == source].mean())
        return metrics

    def step_metrics(self, batch: Batch) -> dict[str, float]:
        metrics = data_metrics(batch)
        stats = batch.meta_info.get("rollout") or {}
        if "generated_tokens" in stats:
            metrics["rollout/generated_tokens"] = float(stats["generated_tokens"])
            metrics["rollout/tool_calls"] = float(stats["tool_calls"])
        metrics["training/global_step"] = float(self.global_steps)
        metrics["training/epoch"] = float(self.loader.epoch)
        return metrics

    # -- reporting ---------------------------------------------------------------------

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.tracking.log(metrics, step)

    @contextlib.contextmanager
    def progress(self) -> Iterator[Callable[[], None]]:
        """A progress bar over the run's steps; yields the function that advances it."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=self.console, transient=False) as bar:
            task = bar.add_task("steps", total=self.total_steps, completed=self.global_steps)
            yield lambda: bar.advance(task)

    def report(self) -> None:
        """The summary table and the reward / step-time plot, in the run directory."""
        history = self.tracking.history if self.tracking else []
        steps = [row for row in history if row.get("step", 0) > 0]
        if not steps:
            return
        self.console.print(summary_table(steps))
        chart = plot(history, self.run_dir / "plot.png")  # with step 0: validation before training
        self.console.print(f"metrics, checkpoints and {chart.name} in {self.run_dir}")


def _step_of(path: Path) -> int:
    name = path.name
    if not name.startswith("global_step_") or not name[len("global_step_") :].isdigit():
        raise ConfigError(f"trainer.resume_from_path: expected a global_step_<k> directory, got {str(path)!r}")
    return int(name[len("global_step_") :])


def run(config: Any, console: Console) -> Trainer:
    """The ``skip run`` job: check everything, train, report; workers are freed on any exit."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(select(config, "trainer.seed") or 0)
    trainer = Trainer(config, console)
    console.print(
        f"training {trainer.total_steps} steps: {trainer.settings.train_batch_size} prompts x "
        f"{trainer.settings.rollout.n} samples per step, schedule {trainer.settings.trainer.schedule}, "
        f"run directory {trainer.run_dir}"
    )
    try:
        trainer.start()
        trainer.fit()
    finally:
        trainer.close()
    trainer.report()
    return trainer
