"""The weights a sync sends, as the policy's ranks hold them, and the two ways they leave.

Each bucket's tensors are gathered whole (a collective on every rank when the policy is sharded:
each tensor once, never the whole model), then rank 0 either packs the bucket for Ray's object
store or broadcasts it over the weight group (``skip_core.weight_group``), cast to the engines'
dtype, while the ranks gather the next one: a broadcast in flight and a bucket gathered, two at most.
"""

from __future__ import annotations

import ray
import torch
from skip_core import weight_group
from skip_core.weight_group import Layout, TensorSpec, WeightGroup

from skip_plugin_trainer.rollout.weights import Bucket, pack, plan
from skip_plugin_trainer.train.distributed import full


class Published:
    """``tensors`` (each rank its shards), in buckets of ``megabytes``."""

    def __init__(self, tensors: dict[str, torch.Tensor], megabytes: float) -> None:
        self.tensors = tensors
        self.buckets = plan(((name, t.numel() * t.element_size()) for name, t in tensors.items()), megabytes)

    def layouts(self) -> list[Layout]:
        """Each bucket's tensors, whole, as the trainer holds them."""
        return [
            tuple(TensorSpec(name, _name(self.tensors[name].dtype), tuple(self.tensors[name].shape)) for name in names)
            for names in self.buckets
        ]

    def bucket(self, index: int, first: bool) -> Bucket | None:
        """Bucket ``index`` packed for the object store, on the ``first`` rank (None on the others)."""
        tensors = self._gathered(index)
        return pack({name: tensor.cpu() for name, tensor in tensors.items()}) if first else None

    def send(self, sender: WeightSender | None, dtype: str) -> None:
        """Every bucket over the group, in ``dtype``: broadcast by the rank that holds ``sender``,
        gathered by all."""
        cast, in_flight = weight_group.torch_dtype(dtype), None
        largest = max((sum(self.tensors[n].numel() for n in names) for names in self.buckets), default=0)
        buffers = sender.buffers(largest * cast.itemsize) if sender is not None else []
        for index in range(len(self.buckets)):
            tensors = self._gathered(index)
            if sender is None:
                continue
            # This buffer's last broadcast, two buckets back, was waited for before the one in flight began.
            flat = weight_group.flatten(list(tensors.values()), cast, sender.device, out=buffers[index % 2])
            if in_flight is not None:
                sender.wait(in_flight)
            in_flight = (sender.broadcast(flat), flat)
        if in_flight is not None:
            sender.wait(in_flight)

    def _gathered(self, index: int) -> dict[str, torch.Tensor]:
        return {name: full(self.tensors[name]).detach() for name in self.buckets[index]}


class WeightSender:
    """The policy's rank 0 in the weight group: it hosts the group's store, joins, broadcasts.
    A failed broadcast leaves the group at once, so that the engines waiting in it fail too."""

    def __init__(self, world_size: int, timeout_s: float, device: torch.device) -> None:
        self.address = ray.util.get_node_ip_address()
        self.store = weight_group.host(self.address, world_size, timeout_s)
        self.device = device
        self.group: torch.distributed.ProcessGroup | None = None
        self._buffers: list[torch.Tensor] = []

    def join(self, group: WeightGroup) -> None:
        if group.backend == "gloo":  # gloo moves host memory
            self.device = torch.device("cpu")
        self.group = weight_group.join(group, 0, self.store)

    def buffers(self, nbytes: int) -> list[torch.Tensor]:
        """Two flat buffers of at least ``nbytes``, which a sync's buckets take turns in. In host
        memory they are kept from one sync to the next: a fresh one costs its page faults, which
        measured 1 s per 512 MiB on two busy cores. On a GPU the caching allocator reuses a freed
        block at no cost, and the trainer needs the memory between syncs."""
        if self._buffers and self._buffers[0].numel() >= nbytes and self._buffers[0].device == self.device:
            return self._buffers
        buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._buffers = buffers if self.device.type == "cpu" else []
        return buffers

    def broadcast(self, flat: torch.Tensor):
        try:
            return weight_group.send(self.group, flat)
        except BaseException:
            self.leave()
            raise

    def wait(self, in_flight: tuple) -> None:
        try:
            in_flight[0].wait()
        except BaseException:
            self.leave()
            raise

    def leave(self) -> None:
        group, self.group = self.group, None
        weight_group.leave(group)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
