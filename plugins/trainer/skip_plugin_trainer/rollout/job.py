"""The rollout side of a run, built from config, and the ``skip rollout`` job.

Config sections read here: ``task`` (the embedded default builds its data and model on first
use), ``model.path``, ``data`` (files, lengths, batch size), ``rollout`` (backend, sampling,
``multi_turn``), ``skip`` (roles), ``output_dir``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table
from skip_core import spans
from skip_core.backend import RolloutBackend, backend_factory
from skip_core.batch import Batch
from skip_core.config import ConfigError, Namespace, parse_section, select, to_container
from skip_core.manager import SkipManager

from skip_plugin_trainer.rollout.agent_loop import AgentLoop, LoopConfig
from skip_plugin_trainer.rollout.tools import Tool, ToolParser, load_tools, tool_parser


def prepare_task(config: Any) -> None:
    """Let the configured task create what is missing (data files, a warmed-up model)."""
    name = select(config, "task.name")
    if name is None:
        return
    from skip_core.plugins import registry

    tasks = registry().tasks
    if name not in tasks:
        raise ConfigError(f"task.name: unknown task {name!r} (installed: {', '.join(sorted(tasks)) or 'none'})")
    tasks[name].prepare(Path(select(config, "task.dir") or "runs/embedded"), select(config, "task"))


def model_path(config: Any) -> Path:
    path = select(config, "model.path")
    if path is None or not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model.path: expected a local Hugging Face model directory with a config.json, got {path!r}")
    return Path(path)


def load_tokenizer(config: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path(config))


def loop_config(config: Any) -> LoopConfig:
    section = dict(to_container(select(config, "rollout")) or {})
    section["prompt_length"] = select(config, "data.max_prompt_length")
    section["response_length"] = select(config, "data.max_response_length")
    return parse_section(LoopConfig, "rollout", section)


@dataclass(frozen=True)
class RolloutParts:
    """Everything the agent loop needs that config alone decides, checked before any work."""

    settings: LoopConfig
    tools: dict[str, Tool]
    parser: ToolParser
    backend: Callable[[Any], RolloutBackend]

    @classmethod
    def from_config(cls, config: Any) -> RolloutParts:
        from skip_core.plugins import registry

        settings = loop_config(config)
        backend = backend_factory(str(select(config, "rollout.backend")), registry().backends)
        return cls(
            settings, load_tools(settings.multi_turn.tools_config), tool_parser(settings.multi_turn.format), backend
        )

    def agent_loop(self, config: Any, tokenizer: Any) -> AgentLoop:
        """Start the backend on the model of ``model.path``."""
        section = {**to_container(select(config, "rollout")), "model_path": str(model_path(config))}
        return AgentLoop(self.backend(OmegaConf.create(section)), tokenizer, self.settings, self.tools, self.parser)


def prompt_loader(config: Any, tokenizer: Any, tools: dict) -> Any:
    from skip_plugin_trainer.data import PromptLoader, RLDataset

    schemas = {name: tool.schema for name, tool in tools.items()}
    dataset = RLDataset(select(config, "data.train_files"), tokenizer, select(config, "data"), schemas)
    return PromptLoader(
        dataset,
        batch_size=select(config, "data.train_batch_size"),
        shuffle=bool(select(config, "data.shuffle") if select(config, "data.shuffle") is not None else True),
        seed=select(config, "data.seed") or 0,
    )


def run(config: Any, console: Console) -> Batch:
    """Generate one batch (step 1 of epoch 0) through the configured backend and agent loop."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-shard bars for a model that loads in milliseconds
    SkipManager.init(config)
    spans.configure(config, worker=0)
    parts = RolloutParts.from_config(config)
    if select(config, "task.name") is not None:
        console.print(f"task {select(config, 'task.name')}: data and model under {select(config, 'task.dir')}")
    prepare_task(config)
    tokenizer = load_tokenizer(config)
    loop = parts.agent_loop(config, tokenizer)
    try:
        prompts = next(prompt_loader(config, tokenizer, loop.tools))
        prompts.meta_info["global_steps"] = 1
        SkipManager.set_step(1)
        start = time.perf_counter()
        batch = loop.generate_sequences(prompts)
        seconds = time.perf_counter() - start
    finally:
        loop.shutdown()
        SkipManager.flush()
        spans.close()
    console.print(summary(batch, prompts, tokenizer, config, seconds, loaded=loop.rollouts == 0))
    output = select(config, "output_dir")
    if output:
        from skip_core.store import CacheStore

        path = CacheStore(output, Namespace.from_config(config), "rollout").save(1, batch)
        console.print(f"saved the batch to {path}")
    return batch


def summary(batch: Batch, prompts: Batch, tokenizer: Any, config: Any, seconds: float, loaded: bool) -> Table:
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
    score = task_score(batch, prompts, tokenizer, config)
    if score is not None:
        table.add_row("task score (mean)", f"{score:.3f}")
    return table


def task_score(batch: Batch, prompts: Batch, tokenizer: Any, config: Any) -> float | None:
    """Mean of the configured reward function's score over the samples (tool rewards left out)."""
    if select(config, "task.name") is None or "ground_truth" not in prompts.non_tensor_batch:
        return None
    from skip_plugin_trainer.train.reward import RewardConfig, Rewarder

    rewarder = Rewarder(parse_section(RewardConfig, "reward", select(config, "reward")), tokenizer)
    n = len(batch) // len(prompts)
    keys = ["data_source", "ground_truth", "extra_info"]
    scored = Batch(batch.batch, {k: prompts.non_tensor_batch[k].repeat(n) for k in keys})
    _, parts = rewarder(scored)
    return float(parts["score"].mean())
