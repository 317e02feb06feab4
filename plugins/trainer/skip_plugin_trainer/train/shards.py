"""A trained model's state in a checkpoint, as each rank's shards: torch.distributed.checkpoint
writing safetensors (``HuggingFaceStorageWriter``), every rank its own file, with the offsets of
its slices in the file's header. Any number of ranks reads it back, each only the slices it
holds, so a run resumes with another ``resources.actor.workers`` than it saved with. Nothing is
unpickled: the reader builds its index from the safetensors headers (JSON).

Tensors go under flat names (``model.<name>``, ``optim.<name>.<state>``); the optimizer's
param groups (hyper-parameters, no tensors) are returned for the checkpoint's ``state.json``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from skip_plugin_trainer.train.distributed import own_state, world


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> dict[str, Any]:
    """Write this rank's shards into ``directory`` (every rank calls it); returns what
    ``state.json`` keeps: the param groups, ``None`` while the optimizer has not stepped (its
    state would be made up: torch fills an empty one with a step of 1)."""
    flat, _, optim = _tensors(model, optimizer if optimizer.state else None)
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)  # every rank its file, even one
    try:
        with _alone():
            dcp.save(flat, storage_writer=writer, no_dist=world() == 1)
    except CheckpointException as exc:  # a full disk must read as one, not as dcp's report of it
        raise next((e for e, _ in exc.failures.values() if isinstance(e, OSError)), RuntimeError(str(exc))) from None
    return {"param_groups": optim["param_groups"] if optim else None}


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, saved: dict[str, Any]) -> None:
    """Read this rank's slices of the state ``save`` wrote (with any number of ranks) into
    ``model`` and ``optimizer`` (every rank calls it)."""
    groups = saved.get("param_groups")
    flat, model_state, optim = _tensors(model, optimizer if groups is not None else None)
    with _alone():
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=world() == 1)
    set_model_state_dict(model, model_state)  # tied tensors share storage: the head came with the embedding
    if optim is not None:
        set_optimizer_state_dict(model, optimizer, {"state": optim["state"], "param_groups": groups})


@contextlib.contextmanager
def _alone() -> Iterator[None]:
    """A single rank has no process group, by design: ``dcp`` says it assumes one process anyway."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any] | None]:
    """The flat tensors ``dcp`` saves or fills in place, and the state dicts they belong to."""
    model_state = get_model_state_dict(model)
    own = own_state(model).keys()
    flat = {f"model.{name}": tensor for name, tensor in model_state.items() if name in own}
    optim = get_optimizer_state_dict(model, optimizer) if optimizer is not None else None
    for name, state in (optim or {}).get("state", {}).items():
        for key, value in state.items():
            flat[f"optim.{name}.{key}"] = value
    return flat, model_state, optim
