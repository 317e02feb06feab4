"""Metrics of a training step, named like verl's (``critic/score/mean``, ``timing_s/gen``, ``perf/throughput``)
so verl users read them at a glance, computed from the step's ``Batch``, its timed phases and the engines'
counters. ``tracking.py`` sends them to the loggers; ``summary.py`` draws the end-of-run table and plot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from skip_core.batch import Batch
from skip_core.schedule import GEN, STEP, TRAIN_PHASES


def _stats(name: str, values: torch.Tensor | np.ndarray) -> dict[str, float]:
    """mean/max/min as Python floats; NaN when empty so a batch without loss tokens cannot crash the step."""
    values = torch.as_tensor(values, dtype=torch.float64)
    if values.numel() == 0:
        return {f"{name}/{s}": math.nan for s in ("mean", "max", "min")}
    return {
        f"{name}/mean": float(values.mean()),
        f"{name}/max": float(values.max()),
        f"{name}/min": float(values.min()),
    }


def _lengths(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt and response lengths per row from ``attention_mask`` (prompt = first P columns, response = last T)."""
    width = batch.batch["responses"].shape[-1]
    mask = batch.batch["attention_mask"].float()
    return mask[:, :-width].sum(-1), mask[:, -width:].sum(-1)


def data_metrics(batch: Batch) -> dict[str, float]:
    """Score, reward, advantage and length statistics of one training batch (verl's ``compute_data_metrics``)."""
    tensors = batch.batch
    width = tensors["responses"].shape[-1]
    loss_tokens = tensors["response_mask"].bool()
    prompt_length, response_length = _lengths(batch)
    metrics = {
        **_stats("critic/score", tensors["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", tensors["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", tensors["advantages"][loss_tokens]),
        **_stats("response_length", response_length),
        "response_length/clip_ratio": float((response_length == width).float().mean()),
        **_stats("prompt_length", prompt_length),
    }
    if "num_turns" in batch.non_tensor_batch:
        metrics.update(_stats("num_turns", np.asarray(batch.non_tensor_batch["num_turns"], dtype=np.float64)))
    for part, name in (("reward_timed_out", "reward/timeouts"), ("reward_non_finite", "reward/non_finite")):
        if part in batch.non_tensor_batch:  # samples the reward function gave no score for: they score 0
            metrics[name] = float(np.count_nonzero(np.asarray(batch.non_tensor_batch[part], dtype=bool)))
    if "overlong_reward" in batch.non_tensor_batch:  # reward.overlong_buffer (DAPO)
        overlong = np.asarray(batch.non_tensor_batch["overlong_reward"], dtype=np.float64)
        metrics["reward/overlong_reward/mean"] = float(overlong.mean())
        metrics["reward/overlong_ratio"] = float((overlong < 0).mean())
    return metrics


def timing_metrics(timing: Mapping[str, float], batch: Batch) -> dict[str, float]:
    """Seconds per phase, and milliseconds per token so steps with different lengths compare."""
    prompt_length, response_length = _lengths(batch)
    response_tokens = float(response_length.sum())
    all_tokens = response_tokens + float(prompt_length.sum())
    metrics = {f"timing_s/{name}": float(seconds) for name, seconds in timing.items()}
    if GEN in timing:
        metrics[f"timing_per_token_ms/{GEN}"] = float(timing[GEN]) * 1000 / response_tokens
    for name in TRAIN_PHASES:  # as verl: generation per response token, training per token of the sequence
        if name in timing:
            metrics[f"timing_per_token_ms/{name}"] = float(timing[name]) * 1000 / all_tokens
    return metrics


def throughput_metrics(timing: Mapping[str, float], batch: Batch, n_workers: int = 1) -> dict[str, float]:
    """Tokens per second per worker over the whole step, verl's ``perf/throughput``."""
    tokens = float(batch.batch["attention_mask"].sum())
    step_time = float(timing[STEP])
    return {
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": step_time,
        "perf/throughput": tokens / step_time / n_workers,
    }


def engine_metrics(before: Mapping[str, float], now: Mapping[str, float]) -> dict[str, float]:
    """What the rollout engines did during one step: each counter's increase since ``before``.
    In an overlapped schedule that is the generation running beside the step's training."""
    # A counter lower than before belongs to an engine restarted meanwhile: it counted from zero.
    change = {
        name: value - before.get(name, 0.0) if value >= before.get(name, 0.0) else value for name, value in now.items()
    }
    metrics = {f"rollout/engine/{name}": float(value) for name, value in change.items()}
    if change.get("decode_passes"):
        metrics["rollout/engine/batch_rows_mean"] = change["decode_rows"] / change["decode_passes"]
    return metrics
