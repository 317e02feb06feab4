"""A trained model built for its rank from the model directory's safetensors files.

On one rank, transformers loads it whole. On several, no rank ever holds the whole model: its
parameters are built empty (each on the meta device as it is registered, so no layer is ever
initialised for nothing; buffers, such as rotary frequencies, are computed for real), the model is
sharded, each rank allocates only its shards on its device and reads only their rows from the
files (``safe_open``'s slices: the file is mapped, nothing else is read). A rank's peak host
memory is then about its shard, where loading whole and sharding after needed the whole model on
every rank (61 GB each for a 7B model in float32). The policy, its reference, a LoRA policy's base
and the critic's body are built this way.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from skip_core import reading
from skip_core.layout import DTYPES
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

MAX_INDEX_BYTES = 64 << 20
PIECE_BYTES = 64 << 20  # read at a time: a rank's transient beyond its shards


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device at once (its initialisation
    then computes nothing); buffers are left where they are built."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, parameter: torch.nn.Parameter | None) -> None:
        register(module, name, parameter)
        if parameter is not None and not parameter.is_meta:  # one on meta already may be tied: kept as it is
            kind = type(parameter)
            module._parameters[name] = kind(parameter.to("meta"), requires_grad=parameter.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def pretrained(
    kind: Any, model_path: str, dtype: torch.dtype, kernel: str, device: str,
    shard: Callable[[torch.nn.Module], Any] | None, *, prepare: Callable[[Any], Any] = lambda model: model,
    fresh: Callable[[Any], Mapping[str, torch.Tensor]] | None = None, stored: Callable[[str], str] = str,
    **options: Any,
) -> Any:  # fmt: skip
    """``kind`` (a transformers auto class) of ``model_path`` in ``dtype``: whole (``shard`` None),
    or built sharded. ``prepare`` takes the model as built (train mode, adapters); ``fresh`` gives
    the whole initial value of each parameter the files do not hold (a new head, adapters), drawn
    from a seed so that both ways start alike; ``stored`` names a parameter as the files do;
    ``options`` go to the model's config (``num_labels``)."""
    from transformers import AutoConfig

    if shard is None:
        model = prepare(kind.from_pretrained(model_path, dtype=dtype, attn_implementation=kernel, **options))
        for name, value in (fresh(model) if fresh else {}).items():
            place(model.get_parameter(name), value)
        return model
    config = AutoConfig.from_pretrained(model_path, **options)
    build = functools.partial(kind.from_config, config, dtype=dtype, attn_implementation=kernel)
    with empty_parameters():
        model = prepare(build())
    initial = fresh(model) if fresh else {}  # from the shapes: every parameter is on meta here
    model = shard(model)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=torch.device(device))  # allocates each rank's shards; buffers come back below
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])
    fill(model, Path(model_path), dtype, initial, stored)
    return model


def fill(
    model: torch.nn.Module, directory: Path, dtype: torch.dtype, initial: Mapping[str, torch.Tensor] | None = None,
    stored: Callable[[str], str] = str,
) -> None:  # fmt: skip
    """Each parameter's local rows read from the safetensors file that holds it, with ``pread``
    (a mapped file's pages would count in the rank's resident memory), or taken from ``initial``;
    ``ValueError`` naming a tensor the files lack or hold in another shape."""
    where = _index(directory)
    with contextlib.ExitStack() as files:
        opened: dict[str, Stored] = {}
        for name, parameter in model.named_parameters():
            if initial and name in initial:
                place(parameter, initial[name])
                continue
            key = stored(name)
            if key not in where:
                raise ValueError(f"{directory.name}'s safetensors files hold no {key}")
            if where[key] not in opened:
                opened[where[key]] = Stored(directory / where[key], files)
            local, start = _local(parameter)
            opened[where[key]].read(key, list(parameter.shape), start, local, dtype)


def place(parameter: torch.Tensor, value: torch.Tensor) -> None:
    """This rank's rows of the whole ``value`` into ``parameter`` (a shard or a whole tensor)."""
    local, start = _local(parameter)
    with torch.no_grad():
        local.copy_(value[start : start + local.shape[0]] if local.dim() else value)


def _local(parameter: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of ``parameter`` and the first row of it (FSDP2 shards on rows)."""
    if not isinstance(parameter, DTensor):
        return parameter, 0
    local = parameter.to_local()
    if not local.dim():
        return local, 0
    _, offsets = compute_local_shape_and_global_offset(parameter.shape, parameter.device_mesh, parameter.placements)
    return local, offsets[0]


class Stored:
    """One safetensors file, checked whole by safetensors' own reader, read by row ranges."""

    def __init__(self, path: Path, files: contextlib.ExitStack) -> None:
        with safe_open(str(path), framework="pt"):  # checks the header and every tensor's offsets
            pass
        self.path = path
        # a link is followed: Hugging Face's cache keeps a snapshot's files as links to its blobs
        self.fd = os.open(path, os.O_RDONLY)
        files.callback(os.close, self.fd)
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        (length,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        self.tensors = reading.loads(os.pread(self.fd, length, 8))
        self.data = 8 + length

    def read(self, name: str, shape: list[int], start: int, into: torch.Tensor, dtype: torch.dtype) -> None:
        """Rows ``start``... of tensor ``name`` (as many as ``into`` has) into ``into``, in ``dtype``."""
        entry = self.tensors[name]
        if entry["shape"] != shape:
            raise ValueError(f"{self.path.name} holds {name} as {entry['shape']}, the model's is {shape}")
        stored = getattr(torch, DTYPES[entry["dtype"]])
        row = math.prod(shape[1:]) * torch.empty((), dtype=stored).element_size()
        rows = into.shape[0] if into.dim() else 1
        step = max(1, PIECE_BYTES // max(1, row))
        for first in range(0, rows, step):
            count = min(step, rows - first)
            offset = self.data + entry["data_offsets"][0] + (start + first) * row
            raw = bytearray(os.pread(self.fd, count * row, offset))
            if len(raw) != count * row:
                raise ValueError(f"{self.path.name} ends inside {name}")
            values = torch.frombuffer(raw, dtype=stored).view(count, *shape[1:]) if into.dim() else None
            with torch.no_grad():
                if values is None:
                    into.copy_(torch.frombuffer(raw, dtype=stored).view(()).to(dtype))
                else:
                    into[first : first + count].copy_(values.to(dtype))


def _index(directory: Path) -> dict[str, str]:
    """Tensor name -> the file holding it: the index of a model in several files, or the one file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        document = reading.read_json(index, MAX_INDEX_BYTES)
        weights = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weights, dict) or not all(
            isinstance(file, str) and "/" not in file and file.endswith(".safetensors") for file in weights.values()
        ):
            raise ValueError(f"{index.name}'s weight_map does not name safetensors files of {directory.name}")
        return weights
    single = directory / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single.name)
