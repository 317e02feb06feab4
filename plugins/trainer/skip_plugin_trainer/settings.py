"""The settings of ``skip rollout`` and ``skip run``: every config section, validated once.

The trainer declares its sections here (``SECTIONS``, through ``skip_register_sections``, as any
plugin declares its own); ``RolloutSettings.from_config`` validates every declared section of
the run config at once (``skip_core.sections.parse_sections``, errors naming the key, what is
allowed and the closest match), cross-checks them, and the rest of the runtime gets these typed
objects and never reads raw config. Plugins get the same ``Sections`` and read their own.

This is the lowest module of the trainer: it imports nothing else of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from skip_core.config import ConfigError, Namespace, Steps, StepSet, lookup, parse_section, select, to_container
from skip_core.sections import Sections, parse_sections

from skip_plugin_trainer.algorithm_settings import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    RewardConfig,
)


class _Section(BaseModel):  # as algorithm_settings' (ruff sees a pydantic model only by its own base)
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskConfig(BaseModel):
    """``task``: a registered task that builds data (and a model) under ``dir``. The other keys are
    the task's options: its ``Task.Options``, a subclass of this model, validates them."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str | None = None
    dir: str = "runs/embedded"


class ModelConfig(BaseModel):
    """``model``: a local Hugging Face model directory (the task's, when a task builds one).
    verl's ``model`` section has more keys; skip reads only ``path``."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    path: str | None = None


class DataConfig(BaseModel):
    """The keys of verl's ``data`` section that shape prompts; verl's other keys are left alone."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    train_files: list[StrictStr] = []
    val_files: list[StrictStr] = []
    prompt_key: StrictStr = Field("prompt", min_length=1)
    max_prompt_length: StrictInt = Field(512, gt=0)
    max_response_length: StrictInt = Field(512, gt=0)
    truncation: Literal["left", "right", "middle", "error"] = "error"
    filter_overlong_prompts: StrictBool = True
    train_batch_size: StrictInt = Field(1024, gt=0)
    shuffle: StrictBool = True
    seed: StrictInt = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, values: Any) -> Any:
        """verl's YAML writes null for "the default"."""
        return {k: v for k, v in values.items() if v is not None} if isinstance(values, dict) else values

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, (str, os.PathLike)) else value


class Sampling(_Section):
    n: PositiveInt = 1
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)


class MultiTurn(_Section):
    """``tools_config``: the tools YAML, a path (relative to the working directory) or
    ``pkg://<package>/<path>`` for one shipped inside an installed package."""

    max_turns: PositiveInt = 4
    tools_config: str | None = None
    format: str = "hermes"
    tool_timeout_s: PositiveFloat = 30.0


class RolloutConfig(Sampling):
    """``rollout``: the backend, sampling and the agent loop. The backend's own options are
    sections of their own, nested here (``rollout.hf``, ``rollout.engine_kwargs.vllm``).

    ``seed`` makes rollouts reproducible: each turn of each request samples with a seed derived
    from (seed, step, prompt index, sample offset, turn). ``timeout_s`` bounds one engine call.
    ``val_kwargs`` replaces the sampling settings for validation.
    """

    backend: str = "hf"
    max_model_len: PositiveInt | None = None
    seed: NonNegativeInt | None = 0
    timeout_s: PositiveFloat = 600.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    multi_turn: MultiTurn = MultiTurn()
    val_kwargs: Sampling = Sampling(temperature=0.0)
    # A weight sync sends the model in buckets of this many MiB (verl's key): each side holds
    # about two at a time, not a second copy of the model.
    update_weights_bucket_megabytes: PositiveFloat = 512


class LoopConfig(RolloutConfig):
    """What the agent loop reads: the ``rollout`` section plus the lengths ``data`` sets."""

    prompt_length: PositiveInt
    response_length: PositiveInt

    @property
    def model_len(self) -> int:
        total = self.prompt_length + self.response_length
        return min(self.max_model_len or total, total)


class TrainerConfig(_Section):
    """``trainer``: length of the run, its directory, checkpoints, validation and loggers."""

    project_name: str = "skip"
    experiment_name: str = "run"
    schedule: str = "sync"
    total_epochs: PositiveInt = 1
    total_training_steps: PositiveInt | None = None
    default_local_dir: str = "runs/train"
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = False
    critic_warmup: NonNegativeInt = 0  # steps that train only the critic, the actor from this step on
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None
    max_ckpt_to_keep: PositiveInt | None = None
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = ["console", "jsonl"]
    seed: NonNegativeInt = 0


class RolloutPool(_Section):
    workers: PositiveInt = 1
    cpus_per_worker: PositiveFloat = 1
    max_restarts: NonNegativeInt = 3  # times Ray restarts a lost worker (killed, preempted, out of memory)
    # How long a lost worker may take to come back: placed again (on another node, if its own is
    # gone: an autoscaler may first add one) and its engine loaded. Past it the run stops.
    restart_timeout_s: PositiveFloat = 600
    # Custom resources each worker's bundle asks for besides its CPUs ({node_b: 1}): on a cluster,
    # the pool goes to the nodes started with them (ray start --resources). null: none.
    ray_resources: dict[StrictStr, PositiveFloat] | None = None


class ActorPool(_Section):
    cpus: PositiveFloat = 1
    ray_resources: dict[StrictStr, PositiveFloat] | None = None  # as the rollout pool's


class Resources(_Section):
    """``resources``: the local Ray's CPUs (``num_cpus``, ignored when joining ``RAY_ADDRESS``)
    and each pool's share. ``torch_threads`` sets every worker's intra-op threads; by default
    a worker of an overlapped schedule gets its own CPUs (every worker runs at the same time),
    and one of ``sync`` its share of both pools' CPUs among the workers that run beside it (the
    rollout workers together, then the actor alone)."""

    num_cpus: PositiveInt | None = None
    torch_threads: PositiveInt | None = None
    rollout: RolloutPool = RolloutPool()
    actor: ActorPool = ActorPool()

    def threads(self, cpus: float, overlapped: bool, together: int = 1) -> int:
        """Threads of a worker with ``cpus`` of its own, one of ``together`` that run at once."""
        both = self.rollout.workers * self.rollout.cpus_per_worker + self.actor.cpus
        return self.torch_threads or max(1, int(cpus if overlapped else both / together))


#: The trainer's sections, declared like any plugin's (``skip_register_sections``).
SECTIONS: dict[str, type[BaseModel]] = {
    "task": TaskConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "actor": ActorConfig,
    "critic": CriticConfig,
    "algorithm": AlgorithmConfig,
    "trainer": TrainerConfig,
    "resources": Resources,
}


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """What generating needs: every declared section (``sections``, for plugins), and typed
    ``task`` (the named task's options), ``model``, ``data``, ``rollout`` and ``reward``."""

    sections: Sections
    task: TaskConfig
    model: ModelConfig
    data: DataConfig
    rollout: LoopConfig
    reward: RewardConfig
    namespace: Namespace
    output_dir: str | None = None
    # the steps of ``skip run`` that ``skip rollout`` generates, as ranges
    steps: StepSet = field(default_factory=lambda: StepSet([(1, 1)]))

    @classmethod
    def from_config(cls, config: Any) -> RolloutSettings:
        return cls(**_rollout_fields(config))

    @property
    def backend(self) -> str:
        return self.rollout.backend

    def model_path(self) -> Path:
        """The model directory, checked to be a Hugging Face model (after the task built it)."""
        path = self.model.path
        if path is None or not (Path(path).expanduser() / "config.json").is_file():
            raise ConfigError(
                f"model.path: expected a local Hugging Face model directory with a config.json, got {path!r}"
            )
        return Path(path).expanduser()


@dataclass(frozen=True, kw_only=True)
class RunSettings(RolloutSettings):
    """What ``skip run`` needs on top: ``actor``, ``algorithm``, ``trainer``, ``resources``; cross-checked."""

    actor: ActorConfig
    critic: CriticConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    resources: Resources

    @classmethod
    def from_config(cls, config: Any) -> RunSettings:
        fields = _rollout_fields(config)
        sections = fields["sections"]
        settings = cls(
            **fields,
            actor=sections[ActorConfig],
            critic=sections[CriticConfig],
            algorithm=sections[AlgorithmConfig],
            trainer=sections[TrainerConfig],
            resources=sections[Resources],
        )
        settings.check_sizes()
        return settings

    @property
    def train_batch_size(self) -> int:
        return self.data.train_batch_size

    @property
    def use_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def bypass_mode(self, overlapped: bool) -> bool:
        """Whether the rollout log-probs serve as PPO's old log-probs (see ``RolloutCorrection``)."""
        correction = self.algorithm.rollout_correction
        if correction.bypass_mode is not None:
            return correction.bypass_mode
        return overlapped and correction.rollout_is is None

    def identity(self) -> dict[str, Any]:
        """What a run cannot change mid-way, by key: a checkpoint records it, and resuming with
        other values would continue one run's weights and optimizer under another's rules."""
        fixed = {
            "trainer.schedule": self.trainer.schedule,
            "rollout.backend": self.rollout.backend,
            "rollout.n": self.rollout.n,
            "model.path": str(Path(self.model.path or "").expanduser().absolute()),
        }
        unused = set() if self.use_critic else {"lam"}  # GAE's alone: older GRPO checkpoints lack it
        algorithm = self.algorithm.model_dump(mode="json", exclude={"rollout_correction", "filter_groups", *unused})
        return {**fixed, **{f"algorithm.{key}": value for key, value in algorithm.items()}}

    def check_sizes(self) -> None:
        n, batch = self.rollout.n, self.data.train_batch_size
        models = [("actor", self.actor)] + ([("critic", self.critic)] if self.use_critic else [])
        for name, model in models:
            if batch % model.ppo_mini_batch_size:
                raise ConfigError(
                    f"{name}.ppo_mini_batch_size: {model.ppo_mini_batch_size} prompts do not divide "
                    f"data.train_batch_size={batch}"
                )
            if (model.ppo_mini_batch_size * n) % model.ppo_micro_batch_size:
                raise ConfigError(
                    f"{name}.ppo_micro_batch_size: {model.ppo_micro_batch_size} samples do not divide a mini-batch "
                    f"of {model.ppo_mini_batch_size} prompts x rollout.n={n} = {model.ppo_mini_batch_size * n} samples"
                )
        workers = self.resources.rollout.workers
        if batch % workers:
            raise ConfigError(
                f"resources.rollout.workers: {workers} workers cannot split "
                f"data.train_batch_size={batch} prompts evenly"
            )
        buffer = self.reward.overlong_buffer
        if buffer.enable and buffer.len >= self.data.max_response_length:
            raise ConfigError(
                f"reward.overlong_buffer.len: {buffer.len} tokens leave no unpenalized length below "
                f"data.max_response_length={self.data.max_response_length}"
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

    registered = registry()
    sections = parse_sections(config, registered.sections)
    data, rollout = sections[DataConfig], sections[RolloutConfig]
    check_backend(rollout.backend, sections, registered.backends)
    lengths = {"prompt_length": data.max_prompt_length, "response_length": data.max_response_length}
    return {
        "sections": sections,
        "task": _task(sections[TaskConfig], registered.tasks),
        "model": sections[ModelConfig],
        "data": data,
        "rollout": LoopConfig(**dict(rollout), **lengths),
        "reward": sections[RewardConfig],
        "namespace": Namespace.from_config(config),
        "output_dir": select(config, "output_dir"),
        "steps": _job_steps(select(config, "steps")),
    }


def _job_steps(raw: Any) -> StepSet:
    """``steps``: which steps of ``skip run`` ``skip rollout`` generates, each once and in order.
    Kept as ranges: ``1..1000000000000`` is two numbers, which a check against the run's last step
    refuses before anything would hold a million million of them."""
    if raw is None:
        return StepSet([(1, 1)])
    value = to_container(raw)
    try:
        steps = TypeAdapter(Steps).validate_python(value)
    except ValidationError as exc:
        raise ConfigError(_steps_error(exc, value)) from None
    except ValueError as exc:  # not pydantic's: its words as they are
        raise ConfigError(f"steps: {exc}") from None
    if not steps or steps.ranges[0][0] < 1:
        raise ConfigError(f"steps: expected steps of skip run, which start at 1, got {_shown(value)}")
    return steps


def _steps_error(exc: ValidationError, value: Any) -> str:
    """pydantic's first complaint about ``steps`` as one line naming the item."""
    error = exc.errors()[0]
    key = _step_key(value, error["loc"])
    if error["type"] == "value_error":  # _parse_steps's own words: "the range '5..1' is empty: ..."
        return f"{key}: {error['ctx']['error']}"
    if error["type"] in ("greater_than_equal", "greater_than"):
        return f"{key}: expected steps of skip run, which start at 1, got {_shown(error['input'])}"
    return f"{key}: {_a_step(value)}, got {_shown(error['input'])}"


def _step_key(value: Any, loc: tuple) -> str:
    """``steps``, or ``steps[1]`` for an item of a list (a lone value is validated as a list of one)."""
    items = "".join(f"[{part}]" for part in loc if isinstance(part, int))
    return f"steps{items}" if isinstance(value, list) else "steps"


def _a_step(value: Any) -> str:
    if isinstance(value, list):
        return "expected a step (an integer from 1) or a range like 1..20"
    return "expected a step (an integer from 1), a range like 1..20 or a list of them"


def _shown(value: Any, most: int = 60) -> str:
    """``repr(value)``, cut short: an error line is no place for a pasted file."""
    text = repr(value)
    return text if len(text) <= most else f"{text[: most - 3]}..."


def _task(section: TaskConfig, tasks: dict[str, Any]) -> TaskConfig:
    """The ``task`` section validated by the named task's own ``Options``."""
    if section.name is None:
        return section
    task = lookup("task.name", "task", section.name, tasks)
    return parse_section(task.Options, "task", section.model_dump())
