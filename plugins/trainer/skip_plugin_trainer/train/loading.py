"""A trained model built for its rank from the model directory's safetensors files.

On one rank, transformers loads it whole. On several, no rank ever holds the whole model: its
parameters are built empty (each on the meta device as it is registered, so no layer is ever
initialised for nothing; buffers, such as rotary frequencies, are computed for real), the model is
sharded, each rank allocates only its shards on its device and reads only their rows from the
files (``safe_open``'s slices: the file is mapped, nothing else is read). A rank's peak host
memory is then about its shard, where loading whole and sharding after needed the whole model on
every rank (61 GB each for a 7B model in float32).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import stat
import struct
from collections.abc import Callable, Iterator
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


def causal_lm(
    model_path: str, dtype: torch.dtype, kernel: str, device: str, shard: Callable[[torch.nn.Module], Any] | None
) -> torch.nn.Module:
    """The causal LM of ``model_path`` in ``dtype``: whole (``shard`` None), or built sharded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if shard is None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=kernel)
    config = AutoConfig.from_pretrained(model_path)
    build = functools.partial(AutoModelForCausalLM.from_config, config, dtype=dtype, attn_implementation=kernel)
    return build_sharded(model_path, build, shard, torch.device(device), dtype)


def build_sharded(
    model_path: str, build: Callable[[], torch.nn.Module], shard: Callable[[torch.nn.Module], torch.nn.Module],
    device: torch.device, dtype: torch.dtype,
) -> torch.nn.Module:  # fmt: skip
    """``build()`` (a model from ``model_path``'s config) with empty parameters, ``shard``-ed, then
    each rank's shards allocated on ``device`` and read from the files in ``dtype``."""
    with empty_parameters():
        model = build()
    model = shard(model)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)  # allocates each rank's shards; buffers come back below
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])
    fill(model, Path(model_path), dtype)
    return model


def fill(model: torch.nn.Module, directory: Path, dtype: torch.dtype) -> None:
    """Each parameter's local rows read from the safetensors file that holds it, with ``pread``
    (a mapped file's pages would count in the rank's resident memory); ``ValueError`` naming a
    tensor the files lack or hold in another shape."""
    where = _index(directory)
    with contextlib.ExitStack() as files:
        opened: dict[str, Stored] = {}
        for name, parameter in model.named_parameters():
            if name not in where:
                raise ValueError(f"{directory.name}'s safetensors files hold no {name}")
            if where[name] not in opened:
                opened[where[name]] = Stored(directory / where[name], files)
            stored = opened[where[name]]
            local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
            start = 0
            if isinstance(parameter, DTensor) and local.dim():
                _, offsets = compute_local_shape_and_global_offset(
                    parameter.shape, parameter.device_mesh, parameter.placements
                )
                start = offsets[0]
            stored.read(name, list(parameter.shape), start, local, dtype)


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
