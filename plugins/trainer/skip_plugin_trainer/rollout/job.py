"""The ``skip rollout`` job: one batch through the configured backend and agent loop, summarized."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table
from skip_core import spans
from skip_core.batch import Batch
from skip_core.manager import SkipManager

from skip_plugin_trainer.rollout.parts import RolloutParts, load_tokenizer, prepare_task, prompt_loader
from skip_plugin_trainer.settings import RolloutSettings


def run(config: Any, console: Console) -> Batch:
    """Generate one batch (step 1 of epoch 0) through the configured backend and agent loop."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-shard bars for a model that loads in milliseconds
    settings = RolloutSettings.from_config(config)
    SkipManager.init(config)
    spans.configure(settings.sections, worker=0)
    parts = RolloutParts.from_settings(settings)
    if settings.task.name is not None:
        console.print(f"task {settings.task.name}: data and model under {settings.task.dir}")
    prepare_task(settings)
    tokenizer = load_tokenizer(settings)
    loop = parts.agent_loop(settings, tokenizer)
    try:
        prompts = next(prompt_loader(settings.data, tokenizer, loop.tools))
        prompts.meta_info["global_steps"] = 1
        SkipManager.set_step(1)
        start = time.perf_counter()
        batch = loop.generate_sequences(prompts)
        seconds = time.perf_counter() - start
    finally:
        loop.shutdown()
        SkipManager.flush()
        spans.close()
    console.print(summary(batch, prompts, tokenizer, settings, seconds, loaded=loop.rollouts == 0))
    if settings.output_dir:
        from skip_core.store import CacheStore

        path = CacheStore(settings.output_dir, settings.namespace, "rollout").save(1, batch)
        console.print(f"saved the batch to {path}")
    return batch


def summary(
    batch: Batch, prompts: Batch, tokenizer: Any, settings: RolloutSettings, seconds: float, loaded: bool
) -> Table:
    """What a user wants from one rollout: volume, speed, how requests ended, how good they were."""
    stats = batch.meta_info["rollout"]
    table = Table(title="skip rollout", show_header=False)
    table.add_row("prompts × samples", f"{len(prompts)} × {len(batch) // max(len(prompts), 1)} = {len(batch)} requests")
    if loaded:
        table.add_row("generation", f"loaded from the skip cache in {seconds:.2f} s")
    else:
        table.add_row("generation", f"{stats['generated_tokens']} tokens in {seconds:.2f} s")
        table.add_row("tokens/s", f"{stats['tokens_per_second']:.1f}")
    turns = batch.non_tensor_batch["num_turns"]
    table.add_row("turns per request", f"mean {turns.mean():.2f}, max {turns.max()}")
    table.add_row("tool calls", str(int(batch.non_tensor_batch["tool_calls"].sum())))
    reasons = Counter(batch.non_tensor_batch["finish_reason"].tolist())
    table.add_row("finish reasons", ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items())))
    score = task_score(batch, prompts, tokenizer, settings)
    if score is not None:
        table.add_row("task score (mean)", f"{score:.3f}")
    return table


def task_score(batch: Batch, prompts: Batch, tokenizer: Any, settings: RolloutSettings) -> float | None:
    """Mean of the configured reward function's score over the samples (tool rewards left out)."""
    if settings.task.name is None or "ground_truth" not in prompts.non_tensor_batch:
        return None
    from skip_plugin_trainer.train.reward import Rewarder

    rewarder = Rewarder(settings.reward, tokenizer, settings.data.max_response_length)
    n = len(batch) // len(prompts)
    keys = ["data_source", "ground_truth", "extra_info"]
    scored = Batch(batch.batch, {k: prompts.non_tensor_batch[k].repeat(n) for k in keys})
    _, parts = rewarder(scored)
    return float(parts["score"].mean())
