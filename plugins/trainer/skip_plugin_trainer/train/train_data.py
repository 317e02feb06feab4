"""A run's per-step training data, ``{run_dir}/train_data/step_{step}.safetensors``: the tensors
each phase of a step produced (``responses``, ``response_mask``, rewards, log-probs, values,
advantages, returns; each ``[samples, response_length]``), which ``skip diff`` compares between runs.

Written atomically (a crash leaves the old file or the new one). Read as hostile, like a cache: a
file sent along with a run may be a link, a pipe or anything else, so every file is opened
through ``skip_core.reading`` (a regular file, no link, inside the run directory, bounded in
size), its format, version and step are checked, and nothing but safetensors is ever decoded.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from skip_core import reading, writing
from skip_core.encoding import storable
from skip_core.errors import SkipError

FORMAT = "skip-train-data"
VERSION = "1"
DIRECTORY = "train_data"
#: ``step_<step>`` as ``write_train_data`` names it: ASCII digits (``int()`` takes other scripts' too), no leading
#: zero (one step, one name), at most 18 (a step fits a 64-bit integer).
NAME = re.compile(r"step_(0|[1-9][0-9]{0,17})\.safetensors")
#: One step's tensors: far above any batch a step trains on, far below what would exhaust a machine.
MAX_BYTES = 16 << 30


class TrainDataError(SkipError, ValueError):
    """A training-data file that cannot be read; the message names it and says why."""


#: What a step's batch holds of each phase, per response token (``trainer.save_train_data``).
KEYS = (
    "responses", "response_mask", "rollout_log_probs", "token_level_scores", "token_level_rewards",
    "old_log_probs", "ref_log_prob", "teacher_log_prob", "values", "advantages", "returns",
)  # fmt: skip


def save_train_data(run_dir: Path, step: int, batch: Any) -> None:
    """The step's ``KEYS`` that ``batch`` (a ``Batch``) holds, written for ``skip diff``; a failure
    (a full disk) is a warning: the file is for comparing runs, training goes on without it."""
    tensors = {key: batch.batch[key] for key in KEYS if key in batch.batch}
    try:
        write_train_data(run_dir, step, tensors)
    except OSError as exc:
        warnings.warn(f"trainer.save_train_data: step {step} not saved: {exc}", RuntimeWarning, stacklevel=2)


def write_train_data(run_dir: Path, step: int, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write ``tensors`` as the training data of ``step`` under ``run_dir``, replacing any earlier file."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**18:
        raise ValueError(f"step must be an integer in [0, 10**18), got {step!r}")
    metadata = {"format": FORMAT, "version": VERSION, "step": str(step)}
    return writing.write_bytes(run_dir, f"{DIRECTORY}/step_{step}.safetensors", save(storable(tensors), metadata))


def train_data_steps(run_dir: Path) -> list[int]:
    """The steps that have a training-data file under ``run_dir`` (by name; each is checked when read)."""
    directory = Path(run_dir) / DIRECTORY
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise TrainDataError(f"{directory}: cannot list it: {exc.strerror or exc}") from None
    return sorted(int(match[1]) for name in names if (match := NAME.fullmatch(name)))


def read_train_data(path: Path, root: Path | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one training-data file, checked: ``TrainDataError`` naming it otherwise.

    ``root``: the directory the file must lie in, links resolved (by default the run directory
    holding its ``train_data/``)."""
    path = Path(path)
    match = NAME.fullmatch(path.name)
    if match is None:
        raise TrainDataError(f"{path}: not a training-data file (named step_<step>.safetensors)")
    try:
        # Checked before safetensors maps it: a link, a pipe or a file past the bound is refused unread.
        with (
            reading.opened(path, MAX_BYTES, path.parent.parent if root is None else root),
            safe_open(str(path), framework="pt") as f,
        ):
            problem = _metadata_problem(f.metadata() or {}, match[1])
            tensors = {} if problem else {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    except (OSError, ValueError, SafetensorError) as exc:
        raise TrainDataError(f"{path}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}") from None
    if problem:
        raise TrainDataError(f"{path}: {problem}")
    samples = {len(t) for t in tensors.values() if t.dim() == 2}
    if any(t.dim() != 2 for t in tensors.values()) or len(samples) > 1:
        shapes = ", ".join(f"{key} {tuple(t.shape)}" for key, t in tensors.items())
        raise TrainDataError(f"{path}: tensors are not all [samples, response_length] of one batch ({shapes})")
    return tensors


def _metadata_problem(metadata: Mapping[str, str], step: str) -> str | None:
    found = (metadata.get("format"), metadata.get("version"))
    if found != (FORMAT, VERSION):
        return f"format {found[0]!r} version {found[1]!r}, not {FORMAT} version {VERSION}"
    if metadata.get("step") != step:
        return f"records step {metadata.get('step')!r} but is named step {step}"
    return None
