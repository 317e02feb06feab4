"""Which checkpoint a run resumes from, whether it may, and what a checkpoint records for it.

A run directory holds one run. ``trainer.resume_mode=auto`` continues it from its newest
checkpoint that verifies, but only under the settings it was saved with where a run cannot
change them mid-way (``RunSettings.identity``: schedule, backend, model, algorithm): resuming
another run's weights and optimizer under other rules would train neither. A checkpoint at or
past the run's last step leaves nothing to train. Both are decided before Ray starts, as is a
``trainer.resume_from_path`` that does not verify. The checkpoint a run resumes from is never
pruned while it runs. The trained models' ranks write and read their own shards of it
(``shard_writer``, ``restore``), with any number of ranks; shards the ranks cannot read make it
corrupt, as a hash that does not verify does.

A run holds its directory for its whole life (``claimed``), so that two runs never write one.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from skip_core import files
from skip_core.config import ConfigError
from skip_core.errors import SkipError

from skip_plugin_trainer.actors import settle
from skip_plugin_trainer.config.settings import RunSettings
from skip_plugin_trainer.train.checkpoint import STEP_DIR, CheckpointManager
from skip_plugin_trainer.train.checkpoint_files import GROUPS, Checkpoint, CorruptCheckpoint
from skip_plugin_trainer.train.model_group import ModelGroup
from skip_plugin_trainer.train.phases import actor_updates
from skip_plugin_trainer.train.preflight import check_writable
from skip_plugin_trainer.train.shards import UnreadableShards

WAYS_OUT = "use a new run directory (trainer.default_local_dir=...) or start over here (trainer.resume_mode=disable)"


@contextlib.contextmanager
def claimed(settings: RunSettings, checkpoints: CheckpointManager) -> Iterator[Checkpoint | None]:
    """The run directory (``checkpoints.root``) held by this run for the block (``files.exclusive``:
    a second run on it stops in one line naming this one, before Ray starts; the kernel lets go of a
    killed run's hold), and the checkpoint the run resumes from (``find_checkpoint``). A directory
    that exists is held before its checkpoints are read, since another run may be writing them; a
    new one once it is created, after every check: a run that fails one writes nothing."""
    run_dir = checkpoints.root
    with contextlib.ExitStack() as held:
        existed = run_dir.is_dir()
        if existed:
            _hold(run_dir, held)
        checkpoint = find_checkpoint(settings, checkpoints)
        if not existed:
            _hold(run_dir, held)
        yield checkpoint


def _hold(run_dir: Path, held: contextlib.ExitStack) -> None:
    check_writable(run_dir)  # a directory that cannot be written is named so, not as a lock that failed
    try:
        held.enter_context(files.exclusive(run_dir, "skip run"))
    except files.DirectoryInUse as exc:
        raise files.DirectoryInUse(f"trainer.default_local_dir: {exc}") from None


def find_checkpoint(settings: RunSettings, checkpoints: CheckpointManager) -> Checkpoint | None:
    """The checkpoint this run resumes from, checked against its settings, or ``None``; pinned in
    ``checkpoints``, which then never prune it."""
    trainer = settings.trainer
    if trainer.resume_mode == "disable":
        return None
    if trainer.resume_mode == "resume_path":
        checkpoint = _given(Path(trainer.resume_from_path).expanduser().absolute())
    else:
        checkpoint = checkpoints.latest()
    if checkpoint is not None:
        _check_identity(checkpoint, settings)
        workers = settings.resources.actor.workers
        if checkpoint.shards is None and workers > 1:
            raise ConfigError(
                f"resources.actor.workers: {checkpoint.path} holds one process's state (an older skip's format), "
                f"which resumes on one actor worker, not {workers}: resume with resources.actor.workers=1, and "
                "change it from the next checkpoint on"
            )
        checkpoints.pin(checkpoint.path)
    return checkpoint


def trainer_state(settings: RunSettings, step: int, loader: dict, schedule: dict | None) -> dict[str, Any]:
    """What a checkpoint records beside the weights: the step, where the data stands, the
    schedule's own state, and the settings a resumed run must share."""
    return {"global_steps": step, "loader": loader, "schedule": schedule, "identity": settings.identity()}


def shard_writer(actor: ModelGroup, critic: ModelGroup | None) -> Callable[[Path], dict[str, Any]]:
    """What ``CheckpointManager.save`` calls to have the trained models write their ranks' shards
    into a checkpoint directory, side by side."""
    models = dict(zip(GROUPS, (actor, critic), strict=True))

    def write(directory: Path) -> dict[str, Any]:
        refs = {name: m.submit("save_shards", str(directory / name)) for name, m in models.items() if m}
        answers = settle([ref for ranks in refs.values() for ref in ranks], "saving the checkpoint", "ranks")
        # One wait for both models' ranks; each model's rank 0 answers how to read its shards back.
        firsts = itertools.accumulate([0, *map(len, refs.values())])
        return {name: answers[first] for name, first in zip(refs, firsts, strict=False)}

    return write


def restore(
    checkpoint: Checkpoint,
    settings: RunSettings,
    checkpoints: CheckpointManager,
    actor: ModelGroup,
    critic: ModelGroup | None,
) -> Checkpoint:
    """Load ``checkpoint`` into the trained models and return the one they hold. Shards whose
    hashes and headers verify may still not load (another dtype, recorded again by hand): with
    ``trainer.resume_mode=auto`` the checkpoint is skipped with the warning a hash that does not
    verify gets, for the newest one that does (which then loads over whatever the ranks read);
    a ``trainer.resume_from_path`` stops the run in one line."""
    while True:
        try:
            _load_models(checkpoint, actor, critic, settings.trainer.critic_warmup)
            return checkpoint
        except CorruptCheckpoint as exc:
            if settings.trainer.resume_mode != "auto":
                raise _cannot_resume(exc.path, exc.reason) from None
            checkpoints.reject(exc)
            earlier = find_checkpoint(settings, checkpoints)
            if earlier is None:  # the ranks may hold part of it: they cannot start from scratch
                raise ConfigError(
                    f"trainer.resume_mode: {exc.path} does not load ({exc.reason}) and no earlier checkpoint "
                    f"verifies; {WAYS_OUT}"
                ) from None
            checkpoint = earlier


def _load_models(checkpoint: Checkpoint, actor: ModelGroup, critic: ModelGroup | None, critic_warmup: int) -> None:
    """The trained models' state from ``checkpoint``; their lr schedules continue at the updates
    its steps made (derived, not saved: checkpoints written before skip had schedules resume the
    same way). A checkpoint of format 1 holds the whole state, in the driver."""
    updates = {"actor": actor_updates(checkpoint.step, critic_warmup), "critic": checkpoint.step}
    for name, model in zip(GROUPS, (actor, critic), strict=True):
        if model is None:
            continue
        if checkpoint.shards is not None:
            try:
                model.call("load_shards", str(checkpoint.path / name), checkpoint.shards[name], updates=updates[name])
            except UnreadableShards as exc:  # a rank's, through Ray: its cause is the rank's own message
                cause = str(getattr(exc, "cause", exc))
                raise CorruptCheckpoint(checkpoint.path, f"the {name}'s shards do not load: {cause}") from None
        else:  # the critic's state sits in the trainer's (a checkpoint's algorithm.* match the run's)
            whole = checkpoint.trainer["critic"] if name == "critic" else vars(checkpoint)
            model.call("load_full_state", whole["model"], whole["optimizer"], updates=updates[name])


def nothing_left(checkpoint: Checkpoint, total_steps: int) -> str:
    """The line a run says when its directory holds a checkpoint at or past its last step."""
    return (
        f"nothing to train: {checkpoint.path} is step {checkpoint.step} and this run ends at step {total_steps} "
        f"(trainer.total_training_steps); to train again, {WAYS_OUT}"
    )


def _check_identity(checkpoint: Checkpoint, settings: RunSettings) -> None:
    saved = checkpoint.trainer.get("identity")
    if saved is None:
        warnings.warn(
            f"{checkpoint.path} records no settings to compare with this run's (saved by an older skip): "
            "resuming it as it is",
            stacklevel=3,
        )
        return
    ours = settings.identity()
    differ = [key for key in sorted(ours.keys() | saved.keys()) if ours.get(key) != saved.get(key)]
    if differ:
        changes = ", ".join(f"{key} ({saved.get(key)!r} there, {ours.get(key)!r} here)" for key in differ)
        raise ConfigError(
            f"trainer.resume_mode: the checkpoint {checkpoint.path} was saved by a run with other settings "
            f"that a run cannot change mid-way: {changes}; {WAYS_OUT}"
        )


def _given(path: Path) -> Checkpoint:
    """The checkpoint ``trainer.resume_from_path`` names, verified; a ``ConfigError`` with the way out otherwise."""
    match = STEP_DIR.fullmatch(path.name)
    if match is None:
        raise ConfigError(
            f"trainer.resume_from_path: expected a global_step_<k> directory (k at most 18 digits), got {str(path)!r}"
        )
    if not path.is_dir():
        reason = "no such directory"
    else:
        try:
            return CheckpointManager(path.parent).load(int(match[1]))
        except CorruptCheckpoint as exc:
            reason = exc.reason
    raise _cannot_resume(path, reason)


def _cannot_resume(path: Path, reason: str) -> ConfigError:
    return ConfigError(
        f"trainer.resume_from_path: cannot resume from {path}: {reason}; point it at another global_step_<k> "
        "directory, or set trainer.resume_mode=auto to resume from the newest checkpoint in "
        "trainer.default_local_dir that verifies"
    )


class RunStopped(SkipError, RuntimeError):
    """The run cannot go on: a worker it cannot do without died (the actor, the critic, or a rollout
    worker Ray could not restart), or a checkpoint could not be saved (a full disk). ``checkpoint``
    is the newest intact one the run saved, the one a new run resumes from."""

    def __init__(self, message: str, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


def stopped(what: str, step: int, checkpoints: CheckpointManager) -> RunStopped:
    return RunStopped(f"step {step}: {what}", checkpoints.newest_intact())
