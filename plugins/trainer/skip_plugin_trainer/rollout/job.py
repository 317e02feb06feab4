"""The ``skip rollout`` job: steps of ``skip run`` through the configured backend and agent loop,
summarized; with ``skip.rollout`` on, the cache a later ``skip run`` trains on without an engine.

Each step is written (cache entry, ``output_dir``) as it finishes and only its totals are kept,
so a thousand steps take the memory of one; steps past the run's last are refused up front."""

from __future__ import annotations

import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from skip_core import spans, writing
from skip_core.batch import Batch
from skip_core.config import ConfigError, StepSet
from skip_core.manager import SkipManager
from skip_core.progress import progress, waiting
from skip_core.schedule import GLOBAL_STEPS, INDEX_BASE
from skip_core.store import CacheStore

from skip_plugin_trainer.config.sections import TrainerConfig
from skip_plugin_trainer.config.settings import RolloutSettings
from skip_plugin_trainer.data import PromptLoader, RLDataset, generation_inputs
from skip_plugin_trainer.rollout.agent_loop import AgentLoop
from skip_plugin_trainer.rollout.parts import RolloutParts, load_tokenizer, prepare_task, prompt_loader
from skip_plugin_trainer.rollout.stats import merge_rollout_stats


@dataclass
class Totals:
    """What the summary reports, added up step by step: no step's batch outlives its step."""

    prompts: int = 0
    samples: int = 0
    turns: int = 0
    most_turns: int = 0
    tool_calls: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    score: float = 0.0  # summed over the samples scored
    scored: int = 0
    stats: dict[str, Any] | None = None  # the steps' ``meta_info["rollout"]``, merged one after the other

    def add(self, prompts: Batch, batch: Batch, scores: np.ndarray | None) -> None:
        extras = batch.non_tensor_batch
        self.prompts += len(prompts)
        self.samples += len(batch)
        self.turns += int(extras["num_turns"].sum())
        self.most_turns = max(self.most_turns, int(extras["num_turns"].max(initial=0)))
        self.tool_calls += int(extras["tool_calls"].sum())
        self.finish_reasons.update(extras["finish_reason"].tolist())
        if scores is not None:
            self.score += float(scores.sum())
            self.scored += len(scores)
        stats = batch.meta_info["rollout"]
        self.stats = stats if self.stats is None else merge_rollout_stats([self.stats, stats], concurrent=False)

    @property
    def mean_score(self) -> float | None:
        return self.score / self.scored if self.scored else None


def run(config: Any, console: Console) -> Totals:
    """Generate the ``steps`` of ``skip run`` (step 1 by default) through the configured backend
    and agent loop: each step's prompts and seeds as the run draws them, with the starting weights.
    With ``skip.rollout`` on, each step is a cache entry a later ``skip run`` trains on. Returns
    what the summary reports."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-shard bars for a model that loads in milliseconds
    settings = RolloutSettings.from_config(config)
    check_known_steps(settings)
    SkipManager.activate(settings.roles, settings.namespace, settings.setup)
    SkipManager.hold("skip rollout")
    spans.configure(settings.sections, worker=0)
    parts = RolloutParts.from_settings(settings)
    if settings.task.name is not None:
        console.print(f"task {settings.task.name}: data and model under {settings.task.dir}")
    prepare_task(settings)
    tokenizer, loader, rewarder = load_checked(settings, parts)  # before the engine loads the model
    output = CacheStore(settings.output_dir, settings.namespace, "rollout") if settings.output_dir else None
    if output is not None:  # after every check: a rollout that fails one writes nothing there
        output.hold("skip rollout")
    with waiting(f"starting the {settings.backend} engine"):
        loop = parts.agent_loop(settings, tokenizer)
    totals = Totals()
    start = time.perf_counter()
    samples = len(settings.steps) * settings.generation_batch_size * settings.rollout.n
    try:
        with progress(samples, "generating", unit="samples") as advance:
            loop.on_request = advance
            for step in settings.steps:
                before = loop.rollouts
                prompts, batch = _generate(loop, loader, step)
                if loop.rollouts == before:  # from the skip cache: no request ran
                    advance(len(batch))
                if output is not None:
                    console.print(f"saved step {step} to {output.save(step, batch)}")
                _progress(console, step, batch, cached=loop.rollouts == before, model=settings.model.path)
                totals.add(prompts, batch, _scores(rewarder, prompts, batch))
    finally:
        loop.shutdown()
        SkipManager.flush()
        SkipManager.release()
        if output is not None:
            output.release()
        spans.close()
    seconds = time.perf_counter() - start
    console.print(summary(totals, settings, seconds, loaded=loop.rollouts == 0))
    return totals


def check_known_steps(settings: RolloutSettings) -> None:
    """Refuse steps past ``trainer.total_training_steps`` when it is set: known from the settings
    alone, before the task is built or anything starts."""
    trainer = settings.sections[TrainerConfig]
    if trainer.total_training_steps:
        check_steps(settings.steps, trainer, batches=0)


def load_checked(settings: RolloutSettings, parts: RolloutParts) -> tuple[Any, PromptLoader, Any]:
    """The tokenizer, the prompts and the rewarder, checked as ``skip rollout`` checks them before
    its engine starts (``--check`` runs this too): every step within the run, every row scorable."""
    tokenizer = load_tokenizer(settings)
    loader = prompt_loader(settings, tokenizer, parts.tools)
    check_steps(settings.steps, settings.sections[TrainerConfig], batches=len(loader))
    return tokenizer, loader, task_rewarder(settings, tokenizer, loader.dataset)


def check_steps(steps: StepSet, trainer: TrainerConfig, batches: int) -> None:
    """Refuse steps that ``skip run`` with these settings never reaches: its last step is
    ``trainer.total_training_steps``, else ``batches`` (a pass over the prompts) per epoch."""
    if trainer.total_training_steps:
        last = trainer.total_training_steps
        why = f"trainer.total_training_steps={last}"
        way_out = "raise trainer.total_training_steps for skip run too"
    else:
        last = batches * trainer.total_epochs
        why = (
            f"{batches} batches of data.train_batch_size prompts in data.train_files per epoch "
            f"x trainer.total_epochs={trainer.total_epochs}"
        )
        way_out = "set trainer.total_training_steps or trainer.total_epochs for skip run too"
    past = steps.above(last)
    if past:
        verb = "lies" if len(past) == 1 else "lie"
        raise ConfigError(
            f"steps: {past} {verb} past the last step of skip run with these settings ({last}: {why}); "
            f"ask for steps up to {last}, or {way_out}"
        )


def _generate(loop: AgentLoop, loader: PromptLoader, step: int) -> tuple[Batch, Batch]:
    """Step ``step``'s prompts and their samples, as ``skip run`` generates them at that step."""
    loader.seek(step - 1)
    prompts = next(loader)
    inputs = generation_inputs(prompts)
    inputs.meta_info.update({GLOBAL_STEPS: step, INDEX_BASE: 0})  # the run's seeds: its step, each row's index
    SkipManager.set_step(step)
    return prompts, loop.generate_sequences(inputs)


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
        with writing.appending(store.root, store.directory.relative_to(store.root) / "skip_rollout.log") as log:
            log.write(f"{datetime.now().isoformat(timespec='seconds')} {line}, weights: {model} (version 0)\n".encode())
    except OSError as exc:  # a progress log is no reason to stop generating
        warnings.warn(f"skip rollout: cannot append to {store.directory / 'skip_rollout.log'}: {exc}", stacklevel=2)


def summary(totals: Totals, settings: RolloutSettings, seconds: float, loaded: bool) -> Table:
    """What a user wants from one rollout: volume, speed, how requests ended, how good they were."""
    stats = totals.stats or {}
    table = Table(title="skip rollout", show_header=False)
    table.add_row("steps of skip run", f"{settings.steps}, with the starting weights (model.path)")
    per_prompt = totals.samples // max(totals.prompts, 1)
    table.add_row("prompts × samples", f"{totals.prompts} × {per_prompt} = {totals.samples} requests")
    if loaded:
        table.add_row("generation", f"loaded from the skip cache in {seconds:.2f} s")
    else:
        table.add_row("generation", f"{stats['generated_tokens']} tokens in {seconds:.2f} s")
        table.add_row("tokens/s", f"{stats['tokens_per_second']:.1f}")
    mean_turns = totals.turns / max(totals.samples, 1)
    table.add_row("turns per request", f"mean {mean_turns:.2f}, max {totals.most_turns}")
    table.add_row("tool calls", str(totals.tool_calls))
    table.add_row("finish reasons", ", ".join(f"{k}: {v}" for k, v in sorted(totals.finish_reasons.items())))
    if totals.mean_score is not None:
        table.add_row("task score (mean)", f"{totals.mean_score:.3f}")
    return table


def task_rewarder(settings: RolloutSettings, tokenizer: Any, dataset: RLDataset) -> Any:
    """The configured reward function, for the task score, checked against the rows of
    ``dataset`` (``data.train_files``) as ``skip run`` checks them; None without a task."""
    if settings.task.name is None:
        return None
    from skip_plugin_trainer.reward import Rewarder

    rewarder = Rewarder(
        settings.reward, tokenizer, settings.data.max_response_length, settings.sections[TrainerConfig].experiment_name
    )
    rewarder.check_data(dataset, "data.train_files")
    return rewarder


def _scores(rewarder: Any, prompts: Batch, batch: Batch) -> np.ndarray | None:
    """The reward function's score of each sample (tool rewards left out)."""
    if rewarder is None or "ground_truth" not in prompts.non_tensor_batch:
        return None
    n = len(batch) // len(prompts)
    keys = ["data_source", "ground_truth", "extra_info"]
    scored = Batch(batch.batch, {k: prompts.non_tensor_batch[k].repeat(n) for k in keys})
    _, parts = rewarder(scored)
    return parts["score"]
