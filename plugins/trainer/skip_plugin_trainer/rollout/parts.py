"""The rollout side of a run, built from its settings: the task's assets, the tokenizer, the
tools and parser, the backend, the agent loop and the prompt stream. ``skip rollout``, the
trainer and each rollout worker build theirs here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skip_core.backend import Backend, find_backend
from skip_core.config import ConfigError

from skip_plugin_trainer import model_files
from skip_plugin_trainer.config.settings import RolloutSettings
from skip_plugin_trainer.data import PromptLoader, RLDataset
from skip_plugin_trainer.rollout.agent_loop import AgentLoop
from skip_plugin_trainer.rollout.tools import Tool, ToolParser, load_tools, tool_parser


def prepare_task(settings: RolloutSettings) -> None:
    """Let the configured task create what is missing (data files, a warmed-up model); a directory
    it cannot write is a ``ConfigError`` naming ``task.dir``, before anything starts."""
    if settings.task.name is None:
        return
    from skip_core.plugins import registry

    directory = Path(settings.task.dir)
    try:
        registry().tasks[settings.task.name].prepare(directory, settings.task)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and Path(exc.filename) != directory else ""
        raise ConfigError(
            f"task.dir: the {settings.task.name} task cannot build its data and model in {directory}: "
            f"{exc.strerror or exc}{where}; point task.dir at a directory you can write"
        ) from None


def load_tokenizer(settings: RolloutSettings) -> Any:
    """``model.path``'s tokenizer; first, the model is checked to have the positions a sample
    needs (an engine would fail on the first long request, mid-run)."""
    from transformers import AutoConfig, AutoTokenizer

    model_files.check(settings.model_path(), "model.path")
    config = AutoConfig.from_pretrained(settings.model_path(), **settings.model.override_config)
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if positions is not None and settings.rollout.model_len > positions:
        data = settings.data
        raise ConfigError(
            f"data.max_response_length: a prompt of up to data.max_prompt_length={data.max_prompt_length} tokens "
            f"and its response of up to {data.max_response_length} need {settings.rollout.model_len} positions; "
            f"model.path has {positions} (max_position_embeddings): lower either, set rollout.max_model_len, or "
            "raise model.override_config.max_position_embeddings"
        )
    return AutoTokenizer.from_pretrained(settings.model_path())


@dataclass(frozen=True)
class RolloutParts:
    """Everything the agent loop needs that settings alone decide, checked before any work."""

    tools: dict[str, Tool]
    parser: ToolParser
    backend: Backend

    @classmethod
    def from_settings(cls, settings: RolloutSettings) -> RolloutParts:
        turns = settings.rollout.multi_turn
        backend = find_backend(settings.backend)
        return cls(load_tools(turns.tools_config), tool_parser(turns.format), backend)

    def agent_loop(self, settings: RolloutSettings, tokenizer: Any) -> AgentLoop:
        """Start the backend on the model of ``model.path``."""
        backend = self.backend.build(settings.sections[self.backend.Options], settings.model_path())
        return AgentLoop(backend, tokenizer, settings.rollout, self.tools, self.parser)


def prompt_loader(settings: RolloutSettings, tokenizer: Any, tools: dict[str, Tool]) -> PromptLoader:
    """The training prompts of ``data.train_files`` as a resumable stream of generation batches."""
    data = settings.data
    schemas = {name: tool.schema for name, tool in tools.items()}
    dataset = RLDataset(data.train_files, tokenizer, data, schemas)
    return PromptLoader(dataset, batch_size=settings.generation_batch_size, shuffle=data.shuffle, seed=data.seed)
