"""The ``skip rollout`` job: steps of ``skip run`` through the configured backend and agent loop,
summarized; with ``skip.rollout`` on, the cache a later ``skip run`` trains on without an engine."""

from __future__ import annotations

import time
import warnings
from collections import Counter
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from skip_core import spans
from skip_core.batch import Batch
from skip_core.manager import SkipManager

from skip_plugin_trainer.data import PromptLoader, generation_inputs
from skip_plugin_trainer.rollout.agent_loop import AgentLoop
from skip_plugin_trainer.rollout.padding import merge_rollout_stats
from skip_plugin_trainer.rollout.parts import RolloutParts, load_tokenizer, prepare_task, prompt_loader
from skip_plugin_trainer.settings import RolloutSettings


def run(config: Any, console: Console) -> Batch:
    """Generate the ``steps`` of ``skip run`` (step 1 by default) through the configured backend
    and agent loop: each step's prompts and seeds as the run draws them, with the starting weights.
    With ``skip.rollout`` on, each step is a cache entry a later ``skip run`` trains on."""
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
    loader = prompt_loader(settings.data, tokenizer, loop.tools)
    generated: list[tuple[Batch, Batch]] = []
    start = time.perf_counter()
    try:
        for step in settings.steps:
            before = loop.rollouts
            generated.append(_generate(loop, loader, step))
            _save(settings, step, generated[-1][1], console)
            _progress(console, step, generated[-1][1], cached=loop.rollouts == before, model=settings.model.path)
    finally:
        loop.shutdown()
        SkipManager.flush()
        spans.close()
    prompts, batch = (Batch.concat([pair[i] for pair in generated]) for i in (0, 1))
    batch.meta_info["rollout"] = merge_rollout_stats(
        [out.meta_info["rollout"] for _, out in generated], concurrent=False
    )
    seconds = time.perf_counter() - start
    console.print(summary(batch, prompts, tokenizer, settings, seconds, loaded=loop.rollouts == 0))
    return batch


def _generate(loop: AgentLoop, loader: PromptLoader, step: int) -> tuple[Batch, Batch]:
    """Step ``step``'s prompts and their samples, as ``skip run`` generates them at that step."""
    loader.seek(step - 1)
    prompts = next(loader)
    inputs = generation_inputs(prompts)
    inputs.meta_info.update(global_steps=step, index_base=0)  # the run's seeds: its step, each row's index
    SkipManager.set_step(step)
    return prompts, loop.generate_sequences(inputs)


def _save(settings: RolloutSettings, step: int, batch: Batch, console: Console) -> None:
    if settings.output_dir:
        from skip_core.store import CacheStore

        path = CacheStore(settings.output_dir, settings.namespace, "rollout").save(step, batch)
        console.print(f"saved step {step} to {path}")


def _progress(console: Console, step: int, batch: Batch, cached: bool, model: str | None) -> None:
    """A line per step, also appended to the cache's ``skip_rollout.log`` when caching is on:
    what filled the cache, and with which weights, stays beside it."""
    stats = batch.meta_info["rollout"]
    done = "from the skip cache" if cached else f"{stats['generated_tokens']} tokens in {stats['seconds']:.2f} s"
    line = f"step {step}: {len(batch)} samples, {done}"
    console.print(line, soft_wrap=True)
    store = SkipManager.stores().get("rollout")
    if store is None or cached:
        return
    try:
        with open(store.directory / "skip_rollout.log", "a", encoding="utf-8") as log:
            log.write(f"{datetime.now().isoformat(timespec='seconds')} {line}, weights: {model} (version 0)\n")
    except OSError as exc:  # a progress log is no reason to stop generating
        warnings.warn(f"skip rollout: cannot append to {store.directory / 'skip_rollout.log'}: {exc}", stacklevel=2)


def summary(
    batch: Batch, prompts: Batch, tokenizer: Any, settings: RolloutSettings, seconds: float, loaded: bool
) -> Table:
    """What a user wants from one rollout: volume, speed, how requests ended, how good they were."""
    stats = batch.meta_info["rollout"]
    table = Table(title="skip rollout", show_header=False)
    steps = settings.steps
    span = ", ".join(map(str, steps))
    if len(steps) > 2 and steps == tuple(range(steps[0], steps[-1] + 1)):
        span = f"{steps[0]}-{steps[-1]}"
    table.add_row("steps of skip run", f"{span}, with the starting weights (model.path)")
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
