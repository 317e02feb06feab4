"""The settings of ``skip rollout`` and ``skip run``, validated once from the run config.

Every section the runtime reads is parsed here into a typed object at the start of the
command, with errors naming the key (``data.train_batch_size: expected an integer > 0``);
the rest of the runtime gets these objects and never reads raw config. The raw config still
travels to plugins that own a section of their own (``skip`` roles, ``profiling``) and to the
backend, whose options live under ``rollout.<backend>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
)
from skip_core.config import ConfigError, Namespace, lookup, parse_section, select, to_container

from skip_plugin_trainer.data import DataConfig, parse_data_config
from skip_plugin_trainer.rollout.agent_loop import LoopConfig
from skip_plugin_trainer.train.policy import ActorConfig
from skip_plugin_trainer.train.reward import RewardConfig


class RolloutPool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    workers: PositiveInt = 1
    cpus_per_worker: PositiveFloat = 1


class ActorPool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cpus: PositiveFloat = 1


class Resources(BaseModel):
    """``resources``: the local Ray's CPUs (``num_cpus``, ignored when joining ``RAY_ADDRESS``)
    and each pool's share. ``torch_threads`` sets every worker's intra-op threads; by default
    a worker of an overlapped schedule gets its own CPUs (every worker runs at the same time),
    and one of ``sync`` its share of both pools' CPUs among the workers that run beside it (the
    rollout workers together, then the actor alone)."""

    model_config = ConfigDict(extra="forbid")
    num_cpus: PositiveInt | None = None
    torch_threads: PositiveInt | None = None
    rollout: RolloutPool = RolloutPool()
    actor: ActorPool = ActorPool()

    def threads(self, cpus: float, overlapped: bool, together: int = 1) -> int:
        """Threads of a worker with ``cpus`` of its own, one of ``together`` that run at once."""
        both = self.rollout.workers * self.rollout.cpus_per_worker + self.actor.cpus
        return self.torch_threads or max(1, int(cpus if overlapped else both / together))


class TaskConfig(BaseModel):
    """``task``: a registered task that builds data (and a model) under ``dir``; other keys are its options."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str | None = None
    dir: str = "runs/embedded"

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ModelConfig(BaseModel):
    """``model``: a local Hugging Face model directory (the task's, when a task builds one)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    path: str | None = None


class RolloutCorrection(BaseModel):
    """``algorithm.rollout_correction``, verl's keys: how PPO treats samples whose engine log-probs
    (the behaviour policy) differ from the trainer's, as they do when generation runs on older weights.

    ``bypass_mode``: use the rollout log-probs as PPO's old log-probs (no recomputation); null
    means on for overlapped schedules, off for ``sync``. Off, old log-probs are recomputed and
    ``rollout_is`` (``token`` or ``sequence``) weights each token's loss by the importance ratio
    old / rollout, truncated at ``rollout_is_threshold``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    bypass_mode: bool | None = None
    rollout_is: Literal["token", "sequence"] | None = None
    rollout_is_threshold: PositiveFloat = 2.0


class AlgorithmConfig(BaseModel):
    """``algorithm``: the advantage estimator and the optional KL penalty in the reward."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = "grpo"
    gamma: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"] = "kl"
    kl_coef: NonNegativeFloat = 0.001
    rollout_correction: RolloutCorrection = RolloutCorrection()


class TrainerConfig(BaseModel):
    """``trainer``: length of the run, its directory, checkpoints, validation and loggers."""

    model_config = ConfigDict(extra="forbid", frozen=True)
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
        from skip_plugin_trainer.train.metrics import check_backends

        check_backends(value)
        return value


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """What generating needs: ``task``, ``model``, ``data``, ``rollout``, ``reward``, ``output_dir``.

    ``backend_section`` is the raw ``rollout`` section plus ``model_path``, for the backend's
    factory (its own options, e.g. ``rollout.hf``, are its to validate).
    """

    task: TaskConfig
    model: ModelConfig
    data: DataConfig
    rollout: LoopConfig
    reward: RewardConfig
    backend: str
    backend_section: dict[str, Any]
    namespace: Namespace
    output_dir: str | None = None

    @classmethod
    def from_config(cls, config: Any) -> RolloutSettings:
        return cls(**_rollout_fields(config))

    def model_path(self) -> Path:
        """The model directory, checked to be a Hugging Face model (after the task built it)."""
        path = self.model.path
        if path is None or not (Path(path) / "config.json").is_file():
            raise ConfigError(
                f"model.path: expected a local Hugging Face model directory with a config.json, got {path!r}"
            )
        return Path(path)


@dataclass(frozen=True, kw_only=True)
class RunSettings(RolloutSettings):
    """What ``skip run`` needs on top: ``actor``, ``algorithm``, ``trainer``, ``resources``; cross-checked."""

    actor: ActorConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    resources: Resources

    @classmethod
    def from_config(cls, config: Any) -> RunSettings:
        sections = {
            name: parse_section(model, name, select(config, name))
            for name, model in (
                ("actor", ActorConfig),
                ("algorithm", AlgorithmConfig),
                ("trainer", TrainerConfig),
                ("resources", Resources),
            )
        }
        settings = cls(**_rollout_fields(config), **sections)
        settings.check_sizes()
        return settings

    @property
    def train_batch_size(self) -> int:
        return self.data.train_batch_size

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def bypass_mode(self, overlapped: bool) -> bool:
        """Whether the rollout log-probs serve as PPO's old log-probs (see ``RolloutCorrection``)."""
        correction = self.algorithm.rollout_correction
        if correction.bypass_mode is not None:
            return correction.bypass_mode
        return overlapped and correction.rollout_is is None

    def check_sizes(self) -> None:
        actor, n, batch = self.actor, self.rollout.n, self.data.train_batch_size
        if batch % actor.ppo_mini_batch_size:
            raise ConfigError(
                f"actor.ppo_mini_batch_size: {actor.ppo_mini_batch_size} prompts do not divide "
                f"data.train_batch_size={batch}"
            )
        if (actor.ppo_mini_batch_size * n) % actor.ppo_micro_batch_size:
            raise ConfigError(
                f"actor.ppo_micro_batch_size: {actor.ppo_micro_batch_size} samples do not divide a mini-batch of "
                f"{actor.ppo_mini_batch_size} prompts x rollout.n={n} = {actor.ppo_mini_batch_size * n} samples"
            )
        workers = self.resources.rollout.workers
        if batch % workers:
            raise ConfigError(
                f"resources.rollout.workers: {workers} workers cannot split "
                f"data.train_batch_size={batch} prompts evenly"
            )
        correction = self.algorithm.rollout_correction
        if correction.rollout_is and correction.bypass_mode:
            raise ConfigError(
                "algorithm.rollout_correction.rollout_is: needs bypass_mode=false (bypass uses the rollout "
                "log-probs as the old ones, so every weight would be 1)"
            )
        if self.trainer.resume_mode == "resume_path" and not self.trainer.resume_from_path:
            raise ConfigError("trainer.resume_from_path: required with trainer.resume_mode=resume_path")


def _rollout_fields(config: Any) -> dict[str, Any]:
    from skip_core.backend import check_backend
    from skip_core.plugins import registry

    task = parse_section(TaskConfig, "task", select(config, "task"))
    if task.name is not None:
        lookup("task.name", "task", task.name, registry().tasks).check_options(task.options)
    data = parse_data_config(select(config, "data"))
    section = dict(to_container(select(config, "rollout")) or {})
    rollout = parse_section(
        LoopConfig,
        "rollout",
        {**section, "prompt_length": data.max_prompt_length, "response_length": data.max_response_length},
    )
    backend = str(section.get("backend", "hf"))
    model = parse_section(ModelConfig, "model", select(config, "model"))
    check_backend(backend, {**section, "model_path": model.path}, registry().backends)
    return {
        "task": task,
        "model": model,
        "data": data,
        "rollout": rollout,
        "reward": parse_section(RewardConfig, "reward", select(config, "reward")),
        "backend": backend,
        "backend_section": {**section, "model_path": model.path},
        "namespace": Namespace.from_config(config),
        "output_dir": select(config, "output_dir"),
    }
