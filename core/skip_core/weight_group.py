"""Weights over a process group: the trainer broadcasts each bucket, every engine process receives it.

The group's rank 0 is the trainer's first rank; each engine's processes (one per tensor-parallel
shard, each loading the whole tensors it shards) follow from the engine's offset. NCCL on GPUs,
gloo on CPUs: the same collectives, so the CPU tests run the path a cluster runs. A bucket
travels as one flat byte tensor, its tensors' bytes one after another in the layout's order, in
the engines' dtype: one collective per bucket, and the layout SGLang's
``update_weights_from_distributed`` reads as ``load_format="flattened_bucket"``.

The group is formed as SGLang forms its side (a TCP store at rank 0's address, prefixed by the
group's name, then torch's own group constructor), so an SGLang engine joins it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist


class TensorSpec(NamedTuple):
    name: str
    dtype: str  # a torch dtype's name: "float32", "bfloat16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch_dtype(self.dtype).itemsize


Layout = tuple[TensorSpec, ...]  # one bucket's tensors, in the order their bytes travel


class Receiver(NamedTuple):
    """What an engine takes weights in: its processes in a group (``ranks``), the dtype it
    computes in and the device its weights live on (``"cpu"``, ``"cuda"``)."""

    ranks: int
    dtype: str
    device: str


@dataclass(frozen=True)
class WeightGroup:
    """Where a group meets: rank 0's store at ``address:port``. ``name`` is new for every group a
    run forms (torch refuses a name twice in one process)."""

    address: str
    port: int
    world_size: int
    backend: Literal["gloo", "nccl"]
    name: str
    timeout_s: float = 600.0


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a weight bucket names an unknown dtype {name!r}")
    return dtype


def host(address: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, on a port the system picks: the group's address is then ``address:store.port``."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(address, 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)


def join(group: WeightGroup, rank: int, store: dist.Store | None = None) -> dist.ProcessGroup:
    """This process's place in ``group``; returns once every rank has joined. Rank 0 passes its
    ``host`` store, the others connect to it."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    timeout = timedelta(seconds=group.timeout_s)
    if store is None:
        store = dist.TCPStore(group.address, group.port, group.world_size, is_master=False, timeout=timeout)
    # Torch's own constructor, as SGLang calls it: the keys both sides write then match.
    named = dist.PrefixStore(group.name, store)
    pg, _ = _new_process_group_helper(
        group.world_size, rank, [], Backend(group.backend), named, group_name=group.name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(group.world_size)}  # its ranks are its own
    return pg


def leave(pg: dist.ProcessGroup | None) -> None:
    if pg is not None:
        dist.destroy_process_group(pg)


def flatten(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device | str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The tensors cast to ``dtype``, their bytes one after another on ``device``: in the front
    of ``out`` when given (a byte buffer large enough), each tensor copied once into its place."""
    total = sum(t.numel() for t in tensors) * dtype.itemsize
    flat = torch.empty(total, dtype=torch.uint8, device=device) if out is None else out[:total]
    offset = 0
    for tensor in tensors:
        size = tensor.numel() * dtype.itemsize
        flat[offset : offset + size].view(dtype).copy_(tensor.detach().reshape(-1))
        offset += size
    return flat


def unflatten(flat: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Views of a received bucket's tensors, no copy."""
    expected = sum(spec.nbytes for spec in layout)
    if flat.numel() != expected:
        raise ValueError(f"a weight bucket of {flat.numel()} bytes arrived for a layout of {expected}")
    tensors, offset = {}, 0
    for spec in layout:
        dtype = torch_dtype(spec.dtype)
        if offset % dtype.itemsize:
            raise ValueError(f"weight {spec.name} starts at byte {offset}, unaligned for {spec.dtype}")
        tensors[spec.name] = flat[offset : offset + spec.nbytes].view(dtype).view(spec.shape)
        offset += spec.nbytes
    return tensors


def send(pg: dist.ProcessGroup, flat: torch.Tensor) -> Any:
    """Broadcast one flat bucket from rank 0; the returned work's ``wait`` ends it (keep ``flat`` until then)."""
    return dist.broadcast(flat, src=0, group=pg, async_op=True)


def received(
    pg: dist.ProcessGroup, layouts: Sequence[Layout], device: torch.device | str = "cpu", reuse: bool = False
) -> Iterator[dict[str, torch.Tensor]]:
    """Each bucket rank 0 broadcasts, as views, in order. The next bucket's receive is posted
    before one is handed out, so it arrives while the engine loads this one: two buckets at most.
    ``reuse``: two buffers take turns (a fresh one costs its page faults), for a caller done with
    a bucket when it asks for the next; one that keeps the tensors (vLLM's layer-wise reload) must not."""
    sizes = [sum(spec.nbytes for spec in layout) for layout in layouts]
    buffers: list[torch.Tensor] = []

    def post(index: int) -> tuple[Any, torch.Tensor]:
        if not reuse:
            flat = torch.empty(sizes[index], dtype=torch.uint8, device=device)
        else:
            if len(buffers) < 2:
                buffers.append(torch.empty(max(sizes), dtype=torch.uint8, device=device))
            flat = buffers[index % 2][: sizes[index]]
        return dist.broadcast(flat, src=0, group=pg, async_op=True), flat

    pending = post(0) if layouts else None
    for index, layout in enumerate(layouts):
        work, flat = pending
        work.wait()
        pending = post(index + 1) if index + 1 < len(layouts) else None
        yield unflatten(flat, layout)


def layouts_of(specs: Sequence[Sequence[Any]]) -> list[Layout]:
    """Layouts from plain lists (how they cross msgpack and JSON), checked."""
    return [tuple(TensorSpec(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in layout) for layout in specs]


def named(layout: Layout) -> Mapping[str, list]:
    """A layout as SGLang's request takes it: names, dtypes and shapes, each a list."""
    return {
        "names": [spec.name for spec in layout],
        "dtypes": [spec.dtype for spec in layout],
        "shapes": [list(spec.shape) for spec in layout],
    }
