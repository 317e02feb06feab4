"""The settings of ``skip rollout`` and ``skip run``: every config section, validated once.

The trainer declares its sections here (``SECTIONS``, through ``skip_register_sections``, as any
plugin declares its own). ``RolloutSettings.from_config`` is the one validation pass: verl's key
paths become skip's (``verl_keys``), then every declared section, every ``skip.<role>`` and the
top-level keys are validated at once (errors naming the key as the user wrote it, what is allowed
and the closest match), cross-checked, and the cache namespace and setup are built from the typed
values. The rest of the runtime gets these typed objects and never reads raw config; plugins get
the same ``Sections`` and read their own.

It imports only the sections' modules (``sections``, ``algorithm``) and ``verl_keys`` of the trainer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
)
from skip_core.config import (
    PLUGIN_FOLDERS,
    ConfigError,
    Namespace,
    RoleConfig,
    StepSet,
    is_hydra_marker,
    lookup,
    parse_section,
    unknown_key,
)
from skip_core.provenance import Setup
from skip_core.sections import Sections, parse_roles, parse_sections

from skip_plugin_trainer.config.algorithm import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    RewardConfig,
)
from skip_plugin_trainer.config.distillation import DistillationConfig
from skip_plugin_trainer.config.memory_keys import check_budgets, check_offloads
from skip_plugin_trainer.config.placement import Placement, plan
from skip_plugin_trainer.config.sections import (
    DataConfig,
    LoopConfig,
    ModelConfig,
    Resources,
    RolloutConfig,
    TaskConfig,
    TrainerConfig,
)
from skip_plugin_trainer.config.steps import job_steps
from skip_plugin_trainer.config.verl_keys import Resolved, resolve
from skip_plugin_trainer.config.weight_sync import WeightSync, choose

#: What the trainer gives an advantage estimator beside rewards, mask and groups (``Estimator.needs``).
PROVIDED_TO_ESTIMATORS = frozenset({"values", "reward_baselines", "old_log_probs", "rollout_is_weights", "scores"})


def _registered(table: dict[str, Any], name: str, key: str) -> Any:
    if name not in table:
        raise ConfigError(f"{key}: unknown {name!r}; registered: {', '.join(sorted(table))} (skip plugins lists them)")
    return table[name]


def dividing(total: int, given: int) -> str:
    """The way out of a value that does not divide ``total``: the divisors nearest ``given``."""
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    nearest = sorted(sorted(divisors, key=lambda d: (abs(d - given), d))[:4])
    return f"; values that divide it: {', '.join(map(str, nearest))}"


class UnusedKeysWarning(UserWarning):
    """Keys a config passes that change nothing here: verl's GPU tuning and logs, a null task's options."""


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
    "distillation": DistillationConfig,
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
    roles: dict[str, RoleConfig]  # every installed role's skip.<role>
    namespace: Namespace  # the cache's, from the values that train
    setup: Setup  # what generates, recorded with each cache entry
    resolved: Resolved  # the config in skip's paths, and the verl keys that change nothing here
    output_dir: str | None = None
    # the steps of ``skip run`` that ``skip rollout`` generates, as ranges
    steps: StepSet = field(default_factory=lambda: StepSet([(1, 1)]))

    @classmethod
    def from_config(cls, config: Any) -> RolloutSettings:
        return cls(**_rollout_fields(config))

    @property
    def backend(self) -> str:
        return self.rollout.backend

    @property
    def generation_batch_size(self) -> int:
        """Prompts one generation draws: DAPO's ``data.gen_batch_size`` when dynamic sampling keeps
        ``data.train_batch_size`` of them, else the train batch (``skip rollout`` draws as ``skip run``)."""
        gen = self.data.gen_batch_size
        sampling = self.sections[AlgorithmConfig].filter_groups.enable
        return gen if gen is not None and sampling else self.data.train_batch_size

    def dump(self) -> dict[str, Any]:
        """Every setting the run uses, defaults filled in, in skip's paths: what ``--check``
        prints and the loggers record."""
        from skip_core.plugins import registry

        out: dict[str, Any] = {}
        for key, model in sorted(registry().sections.items()):  # a section before those inside it
            value = self.task if model is TaskConfig else self.sections[model]
            *parents, name = key.split(".")
            node = out
            for part in parents:
                node = node.setdefault(part, {})
            node[name] = {**value.model_dump(mode="json"), **node.get(name, {})}
        out["skip"] = {name: role.model_dump(mode="json") for name, role in sorted(self.roles.items())}
        out["steps"] = self.steps.as_config()
        out["output_dir"] = self.output_dir
        return out

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
        try:
            settings.check_sizes()
            settings.check_devices()
            settings.check_algorithms()
        except ConfigError as exc:
            raise ConfigError(_as_written(str(exc), settings.resolved)) from None
        return settings

    @property
    def train_batch_size(self) -> int:
        return self.data.train_batch_size

    @property
    def distillation(self) -> DistillationConfig:
        return self.sections[DistillationConfig]

    @property
    def use_critic(self) -> bool:
        return "values" in self.estimator().needs

    def estimator(self) -> Any:
        """The registered ``algorithm.adv_estimator`` (``algorithms/contract.Estimator``)."""
        from skip_core.plugins import registry

        return _registered(registry().advantage_estimators, self.algorithm.adv_estimator, "algorithm.adv_estimator")

    def check_algorithms(self) -> None:
        """The loss and the estimator named are registered, and what the estimator needs is made."""
        from skip_core.plugins import registry

        loss_mode = self.actor.policy_loss.loss_mode
        _registered(registry().policy_losses, loss_mode, "actor.policy_loss.loss_mode")
        if loss_mode == "bypass_mode" and self.algorithm.rollout_correction.bypass_mode is False:
            raise ConfigError(
                "actor.policy_loss.loss_mode: bypass_mode is the loss of "
                "algorithm.rollout_correction.bypass_mode=true, which is false here"
            )
        if "scores" in self.estimator().needs and not self.algorithm.gdpo_reward_keys:
            raise ConfigError(
                f"algorithm.gdpo_reward_keys: {self.algorithm.adv_estimator} normalises the reward's parts named "
                "here (numbers of the dict the reward function returns); none given"
            )
        weights, keys = self.algorithm.gdpo_reward_weights, self.algorithm.gdpo_reward_keys or ()
        if "scores" in self.estimator().needs and weights is not None and len(weights) != len(keys):
            raise ConfigError(f"algorithm.gdpo_reward_weights: {len(weights)} weights for {len(keys)} gdpo_reward_keys")
        if "sum_pi_squared" in self.estimator().needs and not self.actor.calculate_sum_pi_squared:
            raise ConfigError(
                f"actor.calculate_sum_pi_squared: {self.algorithm.adv_estimator} needs each token's sum of squared "
                "probabilities from the old log-prob pass; set it true (verl's key)"
            )
        missing = sorted(self.estimator().needs - PROVIDED_TO_ESTIMATORS - {"sum_pi_squared"})
        if missing:
            raise ConfigError(
                f"algorithm.adv_estimator: {self.algorithm.adv_estimator} needs {', '.join(missing)}, "
                f"which skip does not compute (it provides {', '.join(sorted(PROVIDED_TO_ESTIMATORS))})"
            )

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def device(self) -> str:
        """Where the policy and the critic train: ``trainer.device``, auto resolved."""
        if self.trainer.device != "auto":
            return self.trainer.device
        return "cuda" if self.resources.actor.gpus_per_worker > 0 else "cpu"

    def placement(self) -> Placement:
        """Which GPU holds which actor rank and engine (``placement.py``)."""
        from skip_core.backend import find_backend

        backend = find_backend(self.rollout.backend)
        return plan(self.resources, backend.devices(self.sections[backend.Options]), self.device)

    def weight_sync(self) -> WeightSync:
        """How weight syncs reach the engines, and why (``weight_sync.py``)."""
        return choose(self.rollout.weight_sync, self.rollout.backend, self.device, self.resources)

    def check_devices(self) -> None:
        """A device the actor pool does not ask Ray for would not be there: Ray shows a worker
        only the GPUs of its bundle. The pools' GPUs must give every rank and engine its own."""
        gpus = self.resources.actor.gpus_per_worker
        if self.trainer.device == "cuda" and gpus == 0:
            raise ConfigError(
                "trainer.device: cuda needs a GPU for each actor worker; set resources.actor.gpus_per_worker "
                "(1: a GPU each)"
            )
        if self.trainer.device == "cpu" and gpus > 0:
            raise ConfigError(
                f"resources.actor.gpus_per_worker: {gpus:g} GPUs asked for an actor that trains on the CPU "
                "(trainer.device=cpu); set trainer.device=cuda or 0 GPUs"
            )
        self.placement()  # refuses what cannot be placed, naming the key
        self.weight_sync()
        unused = check_offloads(self)
        if unused:
            warnings.warn(unused, UnusedKeysWarning, stacklevel=4)

    def bypass_mode(self, overlapped: bool) -> bool:
        """Whether the rollout log-probs serve as PPO's old log-probs (see ``RolloutCorrection``);
        ``actor.policy_loss.loss_mode=bypass_mode`` turns it on, as it is verl's name of its loss."""
        correction = self.algorithm.rollout_correction
        if correction.bypass_mode is not None:
            return correction.bypass_mode
        if self.actor.policy_loss.loss_mode == "bypass_mode":
            return True
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
        if self.model.lora_rank:  # what the checkpoint's adapters are; absent without LoRA, as before it
            lora = self.model.model_dump(mode="json", exclude={"path"})
            fixed.update({f"model.{key}": value for key, value in lora.items()})
        unused = set() if self.use_critic else {"lam"}  # GAE's alone: older GRPO checkpoints lack it
        algorithm = self.algorithm.model_dump(mode="json", exclude={"rollout_correction", "filter_groups", *unused})
        return {**fixed, **{f"algorithm.{key}": value for key, value in algorithm.items()}}

    def _check_generation_size(self) -> None:
        gen, batch = self.data.gen_batch_size, self.data.train_batch_size
        if gen is None or gen == batch or self.algorithm.filter_groups.enable:
            return
        if self.trainer.schedule == "fully_async":
            if gen != 1:
                raise ConfigError(f"data.gen_batch_size: fully_async feeds prompts one by one (verl's 1), got {gen}")
            return
        raise ConfigError(
            f"data.gen_batch_size: {gen} prompts per generation differ from data.train_batch_size={batch}, "
            "which only DAPO's dynamic sampling uses (algorithm.filter_groups.enable=true keeps "
            "train_batch_size of them)"
        )

    def check_sizes(self) -> None:
        n, batch = self.rollout.n, self.data.train_batch_size
        models = [("actor", self.actor)] + ([("critic", self.critic)] if self.use_critic else [])
        for name, model in models:
            if batch % model.ppo_mini_batch_size:
                raise ConfigError(
                    f"{name}.ppo_mini_batch_size: {model.ppo_mini_batch_size} prompts do not divide "
                    f"data.train_batch_size={batch}{dividing(batch, model.ppo_mini_batch_size)}"
                )
            workers, samples = self.resources.actor.workers, model.ppo_mini_batch_size * n
            if samples % workers:
                raise ConfigError(
                    f"resources.actor.workers: {workers} workers cannot share the {name}'s mini-batch of "
                    f"{model.ppo_mini_batch_size} prompts x rollout.n={n} = {samples} samples evenly"
                    f"{dividing(samples, workers)}"
                )
            if samples % model.ppo_micro_batch_size:
                raise ConfigError(
                    f"{name}.ppo_micro_batch_size: {model.ppo_micro_batch_size} samples do not divide a mini-batch "
                    f"of {model.ppo_mini_batch_size} prompts x rollout.n={n} = {samples} samples"
                    f"{dividing(samples, model.ppo_micro_batch_size)}"
                )
            check_budgets(name, model, self.data)
        self._check_generation_size()
        workers, generated = self.resources.rollout.workers, self.generation_batch_size
        if generated % workers:
            size = "data.gen_batch_size" if generated != batch else "data.train_batch_size"
            raise ConfigError(
                f"resources.rollout.workers: {workers} workers cannot split {size}={generated} prompts evenly"
                f"{dividing(generated, workers)}"
            )
        buffer = self.reward.overlong_buffer
        if buffer.enable and buffer.len >= self.data.max_response_length:
            raise ConfigError(
                f"reward.overlong_buffer.len: {buffer.len} tokens leave no unpenalized length below "
                f"data.max_response_length={self.data.max_response_length}"
            )
        correction = self.algorithm.rollout_correction
        try:  # what verl refuses: a threshold its option cannot read, an option it does not know
            correction.check()
        except ValueError as exc:  # "<key>: <why>"
            raise ConfigError(f"algorithm.rollout_correction.{exc}") from None
        if self.trainer.resume_mode == "resume_path" and not self.trainer.resume_from_path:
            raise ConfigError("trainer.resume_from_path: required with trainer.resume_mode=resume_path")


def _rollout_fields(config: Any) -> dict[str, Any]:
    from skip_core.backend import check_backend
    from skip_core.plugins import registry

    registered = registry()
    if not isinstance(config, dict) and not hasattr(config, "items"):
        raise ConfigError(f"config: expected a mapping of sections, got {type(config).__name__}")
    resolved = resolve(config)
    raw = resolved.config
    try:
        check_top_level(raw, registered.sections, {"steps", "output_dir"})
        steps = job_steps(raw.get("steps"))  # before skip.rollout.steps, which skip rollout's yaml sets to it
        sections = parse_sections(raw, registered.sections)
        roles = parse_roles(raw.get("skip"), registered.roles)
        data, rollout = sections[DataConfig], sections[RolloutConfig]
        check_backend(rollout.backend, sections, registered.backends)
        task = _task(sections[TaskConfig], registered.tasks)
        output_dir = raw.get("output_dir")
    except ConfigError as exc:
        raise ConfigError(_as_written(str(exc), resolved)) from None
    if output_dir is not None and not isinstance(output_dir, str):
        raise ConfigError(f"output_dir: expected a directory path, got {output_dir!r}")
    warning = resolved.warning()
    if warning:
        warnings.warn(warning, UnusedKeysWarning, stacklevel=4)
    _warn_lora_unused(sections[ModelConfig])
    lengths = {"prompt_length": data.max_prompt_length, "response_length": data.max_response_length}
    loop = LoopConfig(**dict(rollout), **lengths, chat_template_kwargs=data.apply_chat_template_kwargs)
    model = sections[ModelConfig]
    return {
        "sections": sections,
        "task": task,
        "model": model,
        "data": data,
        "rollout": loop,
        "reward": sections[RewardConfig],
        "roles": roles,
        "namespace": _namespace(sections[TrainerConfig], data, loop),
        "setup": Setup(_engine_setup(loop, sections, registered.sections), {"path": model.path}),
        "resolved": resolved,
        "output_dir": output_dir,
        "steps": steps,
    }


def check_top_level(config: dict[str, Any], declared: dict[str, type[BaseModel]], others: set[str]) -> None:
    """Every top-level key is a declared section (or holds one), ``skip``, or one of ``others``.
    A section of a plugin this repository ships may stand there while the plugin is not
    installed (the shipped configs carry some): ``parse_sections`` refuses it turned on."""
    shipped = {name for kind, name in PLUGIN_FOLDERS if kind == "section"}
    allowed = {key.split(".")[0] for key in (*declared, *shipped)} | {"skip"} | others
    for key in config:
        if key not in allowed and not is_hydra_marker(key):
            raise ConfigError(f"{key}: {unknown_key(str(key), allowed)}")


def _warn_lora_unused(model: ModelConfig) -> None:
    """LoRA's other keys mean nothing without ``model.lora_rank``: said, as verl would not."""
    default = ModelConfig()
    keys = ("lora_alpha", "target_modules", "exclude_modules")
    given = [f"model.{key}" for key in keys if getattr(model, key) != getattr(default, key)]
    if given and not model.lora_rank:
        warnings.warn(f"{', '.join(given)}: unused with model.lora_rank=0 (no LoRA)", UnusedKeysWarning, stacklevel=5)


def _as_written(message: str, resolved: Resolved) -> str:
    """An error line naming the key as the user wrote it (``actor_rollout_ref.rollout.n``, skip's ``rollout.n``)."""
    key, sep, rest = message.partition(": ")
    written = resolved.written(key) if sep else key
    return message if written == key else f"{written} (skip's {key}): {rest}"


def _namespace(trainer: TrainerConfig, data: DataConfig, rollout: LoopConfig) -> Namespace:
    """The cache's namespace, as verl names it, from the values this run trains with."""
    return Namespace(
        experiment_name=trainer.experiment_name,
        project_name=trainer.project_name,
        gbs=data.gen_batch_size or data.train_batch_size,
        n=rollout.n,
        prompt_len=data.max_prompt_length,
        response_len=data.max_response_length,
    )


def _engine_setup(rollout: LoopConfig, sections: Sections, declared: dict[str, type[BaseModel]]) -> dict[str, Any]:
    """The ``rollout`` section as ``Setup`` reads it, with the backend's own section (its dtype)."""
    values = rollout.model_dump(mode="json")
    for key in (f"rollout.{rollout.backend}", f"rollout.engine_kwargs.{rollout.backend}"):
        if key in declared:
            values["engine_kwargs"] = {rollout.backend: sections[declared[key]].model_dump(mode="json")}
    return values


def _task(section: TaskConfig, tasks: dict[str, Any]) -> TaskConfig:
    """The ``task`` section validated by the named task's own ``Options``; without a task, only
    ``name`` and ``dir``."""
    if section.name is None:
        extra = sorted(section.model_extra or {})
        if extra:  # the shipped configs carry the embedded task's: said, not silently dropped
            keys = ", ".join(f"task.{key}" for key in extra)
            warnings.warn(f"{keys}: options of a task, unused with task.name=null", UnusedKeysWarning, stacklevel=5)
        return TaskConfig(dir=section.dir)
    task = lookup("task.name", "task", section.name, tasks)
    return parse_section(task.Options, "task", section.model_dump())
