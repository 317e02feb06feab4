"""verl's learning-rate schedule of ``actor.optim`` and ``critic.optim``: a linear warm-up from 0,
then a constant lr or a cosine decay to ``min_lr_ratio`` x lr (verl's
``get_{constant,cosine}_schedule_with_warmup``, zero-indexed).

The schedule counts updates: a worker steps it once per ``update`` call (a training step, however
many mini-batches and epochs it holds), after the update's last optimizer step, as verl's workers
do. Update ``k`` (from 0) trains at ``lr x lr_factor(k)``; with a warm-up the first one trains at
lr 0, as in verl. A resumed worker rebuilds it at the count of updates its checkpoint's step implies.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from skip_plugin_trainer.config.algorithm import Optim


def warmup_steps(optim: Optim, total_steps: int | None) -> int:
    """``lr_warmup_steps`` when positive, else ``lr_warmup_steps_ratio`` x the run's steps, rounded down."""
    if optim.lr_warmup_steps > 0:
        return optim.lr_warmup_steps
    if optim.lr_warmup_steps_ratio == 0:
        return 0
    return int(optim.lr_warmup_steps_ratio * _total(total_steps, "lr_warmup_steps_ratio"))


def lr_factor(optim: Optim, total_steps: int | None, update: int) -> float:
    """The lr of update ``update`` (counted from 0), as a fraction of ``optim.lr``."""
    return _factor(optim, total_steps, warmup_steps(optim, total_steps), update)


def scheduler(optimizer: torch.optim.Optimizer, optim: Optim, total_steps: int | None, updates: int = 0) -> LambdaLR:
    """The schedule after ``updates`` updates; the optimizer's lr becomes its base lr x the factor.

    The base lr is each param group's ``initial_lr`` (torch's schedulers keep it there, so a
    checkpoint's optimizer state carries it), else the group's lr: a fresh optimizer's, or that of
    one loaded from a checkpoint saved before skip had schedules, whose lr was constant.
    """
    if updates < 0:
        raise ValueError(f"updates must not be negative, got {updates}")
    warmup = warmup_steps(optim, total_steps)
    if optim.lr_scheduler_type == "cosine":
        _total(total_steps, "lr_scheduler_type=cosine")
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return LambdaLR(optimizer, functools.partial(_factor, optim, total_steps, warmup), last_epoch=updates - 1)


def _factor(optim: Optim, total_steps: int | None, warmup: int, update: int) -> float:
    if update < warmup:
        return update / max(1, warmup)
    if optim.lr_scheduler_type == "constant":
        return 1.0
    progress = (update - warmup) / max(1, _total(total_steps, "lr_scheduler_type=cosine") - warmup)
    low = optim.min_lr_ratio
    wave = math.cos(math.pi * optim.num_cycles * 2.0 * progress)
    return max(low, wave * (1 - low) * 0.5 + (1 + low) * 0.5)


def _total(total_steps: int | None, needs: str) -> int:
    if total_steps is None:
        raise ValueError(f"optim.{needs} needs the run's total training steps, and none were given")
    return total_steps
