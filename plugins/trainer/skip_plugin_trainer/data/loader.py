"""Prompt batches for training: a resumable stream of ``Batch``es over a dataset.

The order of an epoch depends only on (seed, epoch), so a loader restored from
``state_dict()`` yields exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from skip_core.batch import Batch
from skip_core.config import ConfigError

from skip_plugin_trainer.data.dataset import RLDataset

# What the rollout workers need of a prompt batch; the rest stays with the trainer.
GEN_TENSORS = ("input_ids", "attention_mask", "position_ids")
GEN_NON_TENSORS = ("raw_prompt_ids", "raw_prompt", "tools_kwargs")


def generation_inputs(prompts: Batch) -> Batch:
    """Pop what generating needs out of a prompt batch (verl's ``pop``). Every generation goes
    through here, so a skip entry's input fingerprint is the same whoever wrote it."""
    return prompts.pop(GEN_TENSORS, [k for k in GEN_NON_TENSORS if k in prompts.non_tensor_batch])


def collate(items: Sequence[Mapping[str, Any]]) -> Batch:
    """Stack the tensors of dataset items; every other value becomes one entry of a 1-d object array."""
    if not items:
        raise ValueError("collate needs at least one item")
    first = items[0]
    tensors = {k: torch.stack([item[k] for item in items]) for k, v in first.items() if isinstance(v, torch.Tensor)}
    others = {k: [item[k] for item in items] for k, v in first.items() if not isinstance(v, torch.Tensor)}
    return Batch.from_dict(tensors, others)


class PromptLoader:
    """Batches of a dataset, epoch after epoch, resumable mid-epoch.

    The order of epoch ``e`` is ``numpy.random.default_rng([seed, e]).permutation(len(dataset))``
    (or dataset order without ``shuffle``): it depends on nothing else, so no generator state
    needs saving and NumPy guarantees the stream across versions.

    Two ways to drive it, sharing one position:

    - ``for batch in loader:`` yields the rest of the current epoch, then stops; a trainer runs
      ``for epoch in range(loader.epoch, total_epochs): for batch in loader: ...``.
    - ``next(loader)`` returns the next batch, going on into the next epoch without end.

    ``epoch`` and ``position`` always name the next batch: after the last batch of an epoch
    they read ``(epoch + 1, 0)``.
    """

    def __init__(
        self,
        dataset: RLDataset | Sequence[Mapping[str, Any]],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if drop_last and batch_size > len(dataset):
            raise ConfigError(
                f"data.train_batch_size: {batch_size} is more than the {len(dataset)} prompts of the dataset, "
                "so dropping the incomplete last batch leaves none"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._epoch = 0
        self._position = 0
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """Batches of the current epoch already handed out."""
        return self._position

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return len(self.dataset) // self.batch_size
        return math.ceil(len(self.dataset) / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        epoch = self._epoch
        while self._epoch == epoch:
            yield next(self)

    def __next__(self) -> Batch:
        start = self._position * self.batch_size
        batch = collate([self.dataset[int(i)] for i in self.order(self._epoch)[start : start + self.batch_size]])
        self._position += 1
        if self._position == len(self):
            self._epoch, self._position = self._epoch + 1, 0
        return batch

    def seek(self, index: int) -> None:
        """Go to the ``index``-th batch of the stream (0: epoch 0's first): what a run that draws
        one batch per step trains at step ``index + 1``."""
        self._epoch, self._position = divmod(index, len(self))

    def order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order epoch ``epoch`` visits them."""
        if self._order is None or self._order[0] != epoch:
            size = len(self.dataset)
            indices = np.random.default_rng([self.seed, epoch]).permutation(size) if self.shuffle else np.arange(size)
            self._order = (epoch, indices)
        return self._order[1]

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is, plus what must match for a resume to reproduce the order (JSON-able)."""
        return {"epoch": self._epoch, "position": self._position, **self._identity()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; the loader must be built with the same data and settings."""
        for key, mine in self._identity().items():
            if state.get(key) != mine:
                raise ConfigError(
                    f"cannot resume the prompt loader: the checkpoint has {key}={state.get(key)!r}, this run has "
                    f"{mine!r}; the remaining batches would differ from the interrupted run's"
                )
        epoch, position = state.get("epoch"), state.get("position")
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int) and 0 <= position < len(self)):
            raise ValueError(f"loader state: bad epoch {epoch!r} or position {position!r} (of {len(self)} batches)")
        self._epoch, self._position = epoch, position

    def _identity(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "dataset_size": len(self.dataset),
        }
