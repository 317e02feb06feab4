"""A trained model's state in a checkpoint, as each rank's shards: torch.distributed.checkpoint
writing safetensors (``HuggingFaceStorageWriter``), every rank its own file, with the offsets of
its slices in the file's header. Any number of ranks reads it back, each only the slices it
holds, so a run resumes with another ``resources.actor.workers`` than it saved with. Nothing is
unpickled: the reader builds its index from the safetensors headers (JSON).

Tensors go under flat names (``model.<name>``, ``optim.<name>.<state>``); the optimizer's
param groups (hyper-parameters, no tensors) are returned for the checkpoint's ``state.json``.

A shard file may have been rewritten and its hash recorded again (by hand, by a tool, by someone
else). ``describe`` reads what a file holds from its header alone, for the checkpoint's manifest
and for the driver's check before any rank loads; a rank checks the stored tensors against its
model before reading them, since ``dcp`` would cast a float16 tensor into a float32 one without a
word. A rank that cannot read its shards raises ``UnreadableShards``: a corrupt checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from skip_core import layout, reading
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
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


class UnreadableShards(ValueError):
    """Shards that do not load into this model (a header, a sharding record or a tensor that does
    not fit it); the message names the first misfit."""


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, saved: dict[str, Any]) -> None:
    """Read this rank's slices of the state ``save`` wrote (with any number of ranks) into
    ``model`` and ``optimizer`` (every rank calls it); ``UnreadableShards`` when they do not fit."""
    groups = saved.get("param_groups")
    flat, model_state, optim = _tensors(model, optimizer if groups is not None else None)
    reader = HuggingFaceStorageReader(str(directory))
    try:
        _check_fit(flat, reader.read_metadata().state_dict_metadata)
        with _alone():
            dcp.load(flat, storage_reader=reader, no_dist=world() == 1)
    except UnreadableShards:
        raise
    except CheckpointException as exc:  # dcp's report holds each rank's traceback: the cause alone
        cause = next(iter(exc.failures.values()))[0]
        if isinstance(cause, (MemoryError, torch.OutOfMemoryError)):  # the machine's trouble, not the files'
            raise cause from None
        raise UnreadableShards(f"{type(cause).__name__}: {cause}") from None
    except (SafetensorError, KeyError, TypeError, ValueError, OSError) as exc:  # the headers, read before dcp
        raise UnreadableShards(f"{type(exc).__name__}: {exc}") from None
    set_model_state_dict(model, model_state)  # tied tensors share storage: the head came with the embedding
    if optim is not None:
        set_optimizer_state_dict(model, optimizer, {"state": optim["state"], "param_groups": groups})


def _check_fit(flat: Mapping[str, torch.Tensor], stored: Mapping[str, Any]) -> None:
    """Every tensor ``flat`` reads is stored with its dtype and its whole shape (``dcp`` checks
    the shape too, but casts another dtype silently)."""
    for name, tensor in flat.items():
        found = stored.get(name)
        if not isinstance(found, TensorStorageMetadata):
            raise UnreadableShards(f"they lack {name}")
        if found.properties.dtype != tensor.dtype or found.size != tensor.shape:
            raise UnreadableShards(
                f"{name} is stored as {_dtype(found.properties.dtype)} {list(found.size)}, "
                f"this model's is {_dtype(tensor.dtype)} {list(tensor.shape)}"
            )


def describe(file: str | os.PathLike) -> dict[str, list]:
    """What a shard file holds, from its safetensors header alone (no tensor data): for each tensor
    ``[dtype, shape, offsets]``, ``offsets`` being where its slice sits in the whole tensor (the
    file's sharding record, as the reader takes it). ``ValueError`` (or safetensors' own error,
    which also checks the data's offsets) for a header or sharding record the reader cannot use."""
    tensors = layout.header(file)
    with safe_open(os.fspath(file), framework="pt") as f:
        record = (f.metadata() or {}).get(CUSTOM_METADATA_KEY)
    sharding = reading.loads(record) if record is not None else None
    if sharding is not None and not isinstance(sharding, dict):
        raise ValueError("its sharding record is not an object")
    described = {}
    for name, (dtype, shape) in tensors.items():
        if sharding is None:  # written by one process without a record: the reader puts it at 0
            offsets = [0] * len(shape)
        else:
            entry = sharding.get(name)
            offsets = entry.get(SAVED_OFFSETS_KEY) if isinstance(entry, dict) else None
            if not (
                isinstance(offsets, list)
                and len(offsets) == len(shape)
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            ):
                raise ValueError(f"its sharding record gives {name} no offsets for its shape {list(shape)}")
        described[name] = [dtype, list(shape), offsets]
    return described


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
