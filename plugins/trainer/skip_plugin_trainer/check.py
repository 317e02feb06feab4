"""``skip run --check`` and ``skip rollout --check``: the whole configuration validated as the
command would validate it, and nothing started.

Every section, the cross-checks, the schedule, backend, loggers and tools it names, and, when the
task's files are in place (or no task builds them), the model's tokenizer, the data and the reward
function's coverage of its rows. The resolved settings are printed as YAML, in skip's key
paths (the keys that change nothing here are the one warning a run gives). Nothing is
written: no run directory, no cache directory, no task build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from skip_plugin_trainer.config import verl_defaults
from skip_plugin_trainer.config.settings import RolloutSettings, RunSettings
from skip_plugin_trainer.rollout.parts import RolloutParts


def check(config: Any, console: Console, command: str) -> RolloutSettings:
    """Validate ``config`` for ``skip <command>`` and print its settings; a problem raises the
    ``ConfigError`` the command would stop with."""

    from skip_plugin_trainer.rollout.job import check_known_steps, load_checked
    from skip_plugin_trainer.train.preflight import load_data, schedule, warn_unreachable
    from skip_plugin_trainer.train.tracking import check_loggers

    settings = RunSettings.from_config(config) if command == "run" else RolloutSettings.from_config(config)
    parts = RolloutParts.from_settings(settings)
    if isinstance(settings, RunSettings):
        check_loggers(settings.trainer.logger)
        schedule(settings)
    else:
        check_known_steps(settings)
    missing = _to_build(settings)
    if missing:
        console.print(f"# task {settings.task.name} builds {', '.join(missing)} on the first run: not checked")
        _load_user_code(settings)
        if isinstance(settings, RunSettings):
            warn_unreachable(settings, batches=None)
    elif isinstance(settings, RunSettings):
        load_data(settings, parts)
    else:
        load_checked(settings, parts)
    console.print(yaml.safe_dump(settings.dump(), sort_keys=False).rstrip(), soft_wrap=True, markup=False)
    if isinstance(settings, RunSettings):
        lines = [*settings.placement().lines(), settings.weight_sync().line(), *verl_defaults.lines(settings.dump())]
        console.print("\n".join(f"# {line}" for line in lines), soft_wrap=True, markup=False)
    if isinstance(settings, RunSettings) and not missing:
        _print_memory(settings, console)
    return settings


def _print_memory(settings: RunSettings, console: Console) -> None:
    """The estimated memory per actor rank (``memory.py``), or why there is none: YAML comments,
    so that what ``--check`` prints stays one YAML document."""
    from skip_plugin_trainer.memory import summary

    where = "GPU" if settings.device == "cuda" else "CPU rank"
    try:
        estimate = summary(settings)
    except (ValueError, OSError) as exc:  # a model the estimate does not know: the run does not need it
        console.print(f"# memory per {where}: not estimated: {exc}", markup=False)
        return
    lines = [f"# peak memory per {where} in an update, estimated before anything loads (docs/gpus.md), GiB:"]
    for model, *values, total in estimate.rows:
        named = zip(estimate.headers[1:-1], values, strict=True)
        parts = " · ".join(f"{name} {value}" for name, value in named if value not in ("", "0"))
        lines.append(f"#   {model}: {parts} = {total}" if parts else f"#   {model}, sharing each device: {total}")
    for name, plan in estimate.plans.items():
        ranks = f"{plan.ranks} rank{'s' if plan.ranks > 1 else ''}"
        lines.append(
            f"#   {name}: {ranks}, {plan.compute} compute over {plan.master} weights, checkpointing "
            f"{'on' if plan.checkpointing else 'off'}, micro-batches of up to {plan.tokens:,} tokens"
        )
    if settings.resources.colocate:  # the trainer's state goes to the host between its calls (verl's hybrid engine)
        lines.append(
            "#   colocated engines sleep during an update; while they generate, the training state waits in host "
            "memory and the GPU is the engine's (its gpu_memory_utilization)"
        )
    console.print("\n".join(lines), soft_wrap=True, markup=False)


def _load_user_code(settings: RolloutSettings) -> None:
    """The user's files that config keys name, imported: they need no task built."""
    from skip_plugin_trainer.data.custom import dataset_class
    from skip_plugin_trainer.reward import load_reward_function

    if settings.reward.custom_reward_function.path is not None:
        load_reward_function(settings.reward.custom_reward_function)
    if settings.data.custom_cls.path is not None:
        dataset_class(settings.data.custom_cls)


def _to_build(settings: RolloutSettings) -> list[str]:
    """What the configured task has still to build (its model, data files); empty without a task."""
    if settings.task.name is None:
        return []
    data = settings.data
    files = [*data.train_files, *data.val_files]
    missing = [path for path in files if not Path(path).expanduser().is_file()]
    model = settings.model.path
    if model is None or not (Path(model).expanduser() / "config.json").is_file():
        missing.insert(0, f"model.path={model}")
    return missing
