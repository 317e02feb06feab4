"""Weights in buckets: how the actor's state dict travels to the rollout engines.

A sync must cost neither a copy of the model per rollout worker nor the whole model at once on
either side: at 0.5B-7B parameters that memory decides whether a node holds its engine. So the
actor hands over the tensors of one bucket (``rollout.update_weights_bucket_megabytes``, verl's
name) as one object for Ray's object store: one copy per node, mapped by every worker there, the
tensors' bytes written and read without a copy. The engines load bucket after bucket.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from skip_core.weight_group import Layout, TensorSpec, torch_dtype

MEGABYTE = 1 << 20


class Bucket(NamedTuple):
    """Some of the model's tensors, each as its bytes: Ray writes numpy arrays straight into the
    object store, with no copy in the sender's memory, and hands them out without one."""

    specs: tuple[TensorSpec, ...]
    data: tuple[np.ndarray, ...]  # uint8, one per spec

    @property
    def nbytes(self) -> int:
        return sum(int(array.nbytes) for array in self.data)


def plan(sizes: Iterable[tuple[str, int]], megabytes: float) -> list[list[str]]:
    """Names in order, grouped so no bucket passes ``megabytes`` unless one tensor alone does."""
    limit = megabytes * MEGABYTE
    buckets: list[list[str]] = []
    filled = 0
    for name, nbytes in sizes:
        if not buckets or filled + nbytes > limit:
            buckets.append([])
            filled = 0
        buckets[-1].append(name)
        filled += nbytes
    return buckets


def pack(tensors: Mapping[str, torch.Tensor]) -> Bucket:
    """Views of the tensors' bytes (a copy only of a tensor that is not contiguous)."""
    specs = tuple(TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors.items())
    data = tuple(t.detach().contiguous().view(-1).view(torch.uint8).numpy() for t in tensors.values())
    return Bucket(specs, data)


def unpack(bucket: Bucket) -> dict[str, torch.Tensor]:
    """Views of the bucket's arrays, no copy; they may be read-only pages of the object store,
    which the engines only ever read from."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {
            spec.name: torch.from_numpy(array).view(torch_dtype(spec.dtype)).view(spec.shape)
            for spec, array in zip(bucket.specs, bucket.data, strict=True)
        }


class BucketFeed:
    """Buckets handed in one call each, read by a backend's ``update_weights`` as an async
    iterator. ``put`` returns once the backend is done with the bucket (it asked for the next),
    so the caller drops it before fetching another: one bucket in memory at a time."""

    def __init__(self, load: Any) -> None:
        self._queue: asyncio.Queue[Mapping[str, torch.Tensor] | None] = asyncio.Queue(maxsize=1)
        self.loading: asyncio.Task = asyncio.ensure_future(load(self._buckets()))

    async def put(self, bucket: Mapping[str, torch.Tensor]) -> None:
        await self._queue.put(bucket)
        taken = asyncio.ensure_future(self._queue.join())
        await asyncio.wait({taken, self.loading}, return_when=asyncio.FIRST_COMPLETED)
        if not taken.done():
            taken.cancel()
            self.loading.result()  # the backend's error
            raise RuntimeError("update_weights returned before it read every bucket")

    async def close(self) -> None:
        """No more buckets: wait for the backend to finish loading."""
        await self._queue.put(None)
        await self.loading

    async def _buckets(self) -> AsyncIterator[Mapping[str, torch.Tensor]]:
        while (bucket := await self._queue.get()) is not None:
            try:
                yield bucket
            finally:
                self._queue.task_done()
        self._queue.task_done()


class EngineWeights:
    """The engine's weights as the agent loop sees them: the step they are from, and a sync
    under way. ``ready`` is clear while a sync pauses the engine under running requests, and
    ``pauses`` counts those syncs (a request aborted by one is continued, not failed)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.version = 0
        self.pauses = 0
        self.ready = asyncio.Event()
        self.ready.set()
        self._feed: BucketFeed | None = None  # between a sync's first bucket and its last

    async def load_bucket(
        self, bucket: Mapping[str, torch.Tensor], index: int, count: int, version: int, interrupt: bool
    ) -> None:
        if index == 0:
            await self._begin(interrupt)
        elif self._feed is None:
            raise RuntimeError(f"weight bucket {index} of {count} arrived without bucket 0")
        try:
            await self._feed.put(bucket)
            if index == count - 1:
                await self._feed.close()
                self.version = version
        except BaseException:
            await self._end()
            raise
        if index == count - 1:
            await self._end()

    async def receive(self, layouts: Sequence[Layout], version: int, interrupt: bool) -> None:
        """A whole sync over the weight group (``RolloutBackend.receive_weights``)."""
        await self._begin(interrupt, feed=False)
        try:
            await self.backend.receive_weights(layouts)
            self.version = version
        finally:
            await self._end()

    async def _begin(self, interrupt: bool, feed: bool = True) -> None:
        if self._feed is not None:  # a sync whose sender was lost before its last bucket
            await self._end()
        if interrupt:
            self.pauses += 1
            self.ready.clear()
            await self.backend.pause()
        if feed:
            self._feed = BucketFeed(self.backend.update_weights)

    async def _end(self) -> None:
        if self._feed is not None:
            self._feed.loading.cancel()
            self._feed = None
        if not self.ready.is_set():
            self.ready.set()
            await self.backend.resume()
