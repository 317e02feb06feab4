"""Tools for the agent loop: the tool lifecycle, tool-call parsers, and the tools YAML.

A tool follows the reference lifecycle per request: ``create`` when the request starts,
``execute`` for each call the model makes, ``calc_reward`` and ``release`` when the
request ends. Per-sample arguments come from the dataset row's
``extra_info.tools_kwargs[<tool>]`` (``create_kwargs``, ``execute_kwargs``,
``calc_reward_kwargs``, ``release_kwargs``). Tools are plugins (``skip_register_tools``);
the YAML only names registered tools, so a config file can never import code.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from skip_core.config import ConfigError
from skip_core.files import package_file


@dataclass(frozen=True)
class ToolResponse:
    """What the model reads back, plus an optional per-call reward and metrics."""

    text: str
    reward: float = 0.0
    metrics: Mapping[str, Any] = field(default_factory=dict)


class Tool(ABC):
    """Subclass, set ``schema`` (an OpenAI function schema) and implement ``execute``.

    The tools YAML may replace ``schema`` per entry; it is set on the built instance.
    """

    schema: Mapping[str, Any]

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    async def create(self, request_id: str, **create_kwargs: Any) -> None:  # noqa: B027 (optional step)
        """Set up per-request state; nothing by default."""

    @abstractmethod
    async def execute(self, request_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        """Run one call; raising gives the model the error as the tool's response."""

    async def calc_reward(self, request_id: str, **calc_reward_kwargs: Any) -> float:
        return 0.0

    async def release(self, request_id: str, **release_kwargs: Any) -> None:  # noqa: B027 (optional step)
        """Free per-request state; nothing by default."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolParser(ABC):
    @abstractmethod
    def has_tool_call(self, text: str) -> bool: ...

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Split model output into its plain content and its well-formed tool calls.

        Malformed calls are dropped (as in the reference): a turn whose calls are all
        malformed ends as plain text.
        """


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen and Hermes emit."""

    pattern = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def has_tool_call(self, text: str) -> bool:
        return "<tool_call>" in text

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = [call for raw in self.pattern.findall(text) if (call := _hermes_call(raw)) is not None]
        return self.pattern.sub("", text).strip(), calls


def _hermes_call(raw: str) -> ToolCall | None:
    try:
        payload = json.loads(raw)
        arguments = payload["arguments"]
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(payload.get("name"), str) or not isinstance(arguments, dict):
        return None
    return ToolCall(payload["name"], arguments)


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    config: dict[str, Any] = {}
    schema_: dict[str, Any] | None = None

    def __init__(self, **data: Any) -> None:
        if "schema" in data:
            data["schema_"] = data.pop("schema")
        super().__init__(**data)


class _ToolsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tools: list[_Entry]


def load_tools(path: str | Path | None) -> dict[str, Tool]:
    """Instantiate the tools a tools YAML names, keyed by the function name the model calls."""
    if path is None:
        return {}
    import yaml

    path = tools_file(str(path))
    if not path.is_file():
        raise ConfigError(f"rollout.multi_turn.tools_config: no such file {str(path)!r}")
    try:
        spec = _ToolsFile.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    except (ValidationError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()
        raise ConfigError(
            f"{path}: expected `tools: [{{name: <tool>, config: {{...}}}}]`; {' '.join(first[:3])}"
        ) from None
    return {tool.name: tool for tool in map(_build(path), spec.tools)}


def tools_file(path: str) -> Path:
    """The tools YAML at ``path``, relative to the working directory, or at
    ``pkg://<package>/<file>``: shipped inside an installed package, found wherever it is installed."""
    try:
        return package_file(path)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"rollout.multi_turn.tools_config: {path!r} is in package {exc.name!r}, which is not installed"
        ) from None


def _build(path: Path):
    from skip_core.plugins import registry

    factories = registry().tools

    def build(entry: _Entry) -> Tool:
        if entry.name not in factories:
            have = ", ".join(sorted(factories)) or "none"
            raise ConfigError(f"{path}: unknown tool {entry.name!r} (installed tools: {have})")
        tool = factories[entry.name](dict(entry.config))
        if not isinstance(tool, Tool):
            raise ConfigError(f"{path}: the factory of tool {entry.name!r} returned {type(tool).__name__}, not a Tool")
        if entry.schema_ is not None:
            tool.schema = entry.schema_
        return tool

    return build


def tool_parser(name: str) -> ToolParser:
    from skip_core.plugins import registry

    parsers = registry().tool_parsers
    if name not in parsers:
        raise ConfigError(
            f"rollout.multi_turn.format: unknown tool-call format {name!r} (installed: {', '.join(sorted(parsers))})"
        )
    return parsers[name]()
