"""A batch's rows by prompt (the rows sharing an ``index`` id): what the outcome estimators and
the optimal token baselines compute their group statistics over."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class Groups:
    """A batch's rows by prompt: each row's group number (``ids``), each group's rows in batch
    order (``rows``) and each row's group size (``size``, float)."""

    ids: Tensor
    rows: tuple[Tensor, ...]
    size: Tensor

    @classmethod
    def of(cls, index: np.ndarray | Sequence, batch_size: int, device: torch.device) -> Groups:
        """Ids equal as dict keys share a group, as in verl's loops."""
        if len(index) != batch_size:
            raise ValueError(f"index has {len(index)} entries for {batch_size} rows")
        numbers: dict = {}
        ids = torch.tensor([numbers.setdefault(uid, len(numbers)) for uid in index], dtype=torch.long, device=device)
        counts = torch.bincount(ids, minlength=len(numbers))
        rows = torch.argsort(ids, stable=True).split(counts.tolist()) if numbers else ()
        return cls(ids, tuple(rows), counts[ids].float())

    def sum(self, values: Tensor) -> Tensor:
        """Each group's total of ``values`` (rows first), added in batch order by one scatter."""
        return values.new_zeros((len(self.rows), *values.shape[1:])).index_add_(0, self.ids, values)

    def amax(self, values: Tensor) -> Tensor:
        """Each group's largest of ``values`` ([batch])."""
        start = values.new_full((len(self.rows),), float("-inf") if values.is_floating_point() else -1)
        return start.scatter_reduce_(0, self.ids, values, "amax")

    def each(self, stat: Callable[[Tensor], Tensor], single: Tensor) -> Tensor:
        """Per group: ``stat`` of its rows' indices, or ``single`` for a group of one. One call
        per group, so a statistic is computed over the group's own tensor, as verl does."""
        return torch.stack([stat(rows) if len(rows) > 1 else single for rows in self.rows])
