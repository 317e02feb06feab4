"""What a run checks before Ray starts beyond its settings: that its directory can be written, and
that the steps its skip roles list lie within the run. Each says so in one line, not a traceback
at the first checkpoint or a silence over steps a typo put out of reach."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

from skip_core.config import ConfigError
from skip_core.manager import SkipManager

from skip_plugin_trainer.settings import TrainerConfig


class UnreachableStepsWarning(UserWarning):
    """A skip role lists steps past the run's last one: most likely a typo in a range (``1..2000`` for ``1..200``)."""


def warn_unreachable(last_step: int, trainer: TrainerConfig) -> None:
    """Once per skip role whose steps run past ``last_step``: a warning, since the listed ones still work."""
    source = "trainer.total_training_steps"
    if not trainer.total_training_steps:
        source = "trainer.total_epochs over the batches of data.train_files"
    for role, steps in SkipManager.unreachable(last_step).items():
        lie, never = ("step {} lies", "it is") if len(steps) == 1 else ("steps {} lie", "they are")
        warnings.warn(
            f"skip.{role}.steps: {lie.format(steps)} past this run's last step {last_step} ({source}); "
            f"{never} never reached",
            UnreachableStepsWarning,
            stacklevel=3,
        )


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
