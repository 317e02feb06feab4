"""What a run checks before Ray starts beyond its settings: that its data can be read and scored,
that its directory can be written, that the steps its skip roles list lie within the run, and that
its schedule allows its settings.
Each says so in one line, not a traceback at the first checkpoint or a silence over steps a typo
put out of reach. ``skip run --check`` runs the same checks (``skip_plugin_trainer.check``)."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

from skip_core.config import ConfigError, lookup
from skip_core.manager import SkipManager
from skip_core.schedule import Schedule

from skip_plugin_trainer import model_files
from skip_plugin_trainer.config.sections import TrainerConfig
from skip_plugin_trainer.config.settings import RunSettings
from skip_plugin_trainer.data import PromptLoader, RLDataset
from skip_plugin_trainer.reward import Rewarder
from skip_plugin_trainer.rollout.parts import RolloutParts, load_tokenizer, prompt_loader


def schedule(settings: RunSettings) -> Schedule:
    """The configured schedule, built; refused in one line when the settings need another kind."""
    from skip_core.plugins import registry

    built = lookup("trainer.schedule", "schedule", settings.trainer.schedule, registry().schedules)(settings.sections)
    if settings.resources.colocate and built.overlapped:
        raise ConfigError(
            f"resources.colocate: the engines sleep while the actor trains, which trainer.schedule="
            f"{settings.trainer.schedule} does not allow (it generates meanwhile); use the sync schedule"
        )
    return built


class UnreachableStepsWarning(UserWarning):
    """A skip role lists steps past the run's last one: most likely a typo in a range (``1..2000`` for ``1..200``)."""


def warn_unreachable(s: RunSettings, batches: int | None) -> None:
    """Once per skip role whose steps run past the run's last step: a warning, since the listed
    ones still work. ``batches``: the training prompts' batches per epoch, or ``None`` when the
    data is not read yet (``--check`` before the task is built): then only a set
    ``trainer.total_training_steps`` is a last step."""
    trainer = s.trainer
    source = "trainer.total_training_steps"
    if not trainer.total_training_steps:
        if batches is None:
            return
        source = "trainer.total_epochs over the batches of data.train_files"
    last_step = last_step_of(trainer, batches or 0)
    for role, steps in SkipManager.unreachable(s.roles, last_step).items():
        lie, never = ("step {} lies", "it is") if len(steps) == 1 else ("steps {} lie", "they are")
        warnings.warn(
            f"skip.{role}.steps: {lie.format(steps)} past this run's last step {last_step} ({source}); "
            f"{never} never reached",
            UnreachableStepsWarning,
            stacklevel=3,
        )


def last_step_of(trainer: TrainerConfig, batches: int) -> int:
    """A run's last step: ``trainer.total_training_steps``, else ``batches`` per epoch over its epochs."""
    return trainer.total_training_steps or batches * trainer.total_epochs


def check_writable(path: Path) -> None:
    """Create the run directory ``path`` if missing and check a file can be written in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(
            f"trainer.default_local_dir: cannot write the run directory {path}: {exc.strerror or exc}; "
            "point trainer.default_local_dir at a directory you can write"
        ) from None


def load_data(s: RunSettings, parts: RolloutParts) -> tuple[Any, PromptLoader, RLDataset | None, Rewarder]:
    """The tokenizer, the training prompts, the validation set (when validation runs) and the
    rewarder, checked: ``reward.function=task`` can score every row, and the workers split the validation
    set; with LoRA, its target modules are checked against the model; skip roles listing steps past
    the run's last are warned of."""
    if s.model.lora_rank:
        from skip_plugin_trainer.train.lora import check_targets

        check_targets(str(s.model_path()), s.model)
    tokenizer = load_tokenizer(s)
    if s.distillation.enabled:
        check_teacher(s.distillation.teacher_path, tokenizer)
    loader = prompt_loader(s, tokenizer, parts.tools)
    warn_unreachable(s, len(loader))
    val = None
    if s.data.val_files and s.trainer.test_freq > 0:
        schemas = {name: tool.schema for name, tool in parts.tools.items()}
        val = RLDataset(s.data.val_files, tokenizer, s.data, schemas, files_key="data.val_files")
    rewarder = Rewarder(s.reward, tokenizer, s.data.max_response_length, s.trainer.experiment_name)
    rewarder.check_data(loader.dataset, "data.train_files")
    if val is not None:
        rewarder.check_data(val, "data.val_files")
        workers = s.resources.rollout.workers
        if len(val) % workers:
            raise ConfigError(
                f"resources.rollout.workers: {workers} workers cannot split the "
                f"{len(val)} validation prompts of data.val_files evenly"
            )
    return tokenizer, loader, val, rewarder


def check_teacher(path: str, tokenizer: Any) -> None:
    """The distillation teacher reads the student's tokens: its tokenizer must be the student's."""
    from transformers import AutoTokenizer

    key = "distillation.teacher_models"
    model_files.check(path, key)
    try:
        teacher = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot load the teacher's tokenizer from {path}: {exc}") from None
    if teacher.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"{key}: the teacher's tokenizer ({path}, {len(teacher)} tokens) is not the student's (model.path, "
            f"{len(tokenizer)} tokens): its log-probs would be of other tokens"
        )
