"""The prompts of one split, read, rendered with the chat template and length-checked once.

``RLDataset`` reads verl-shaped rows (``rows.py``, or the items of the user's ``data.custom_cls``:
``custom.py``), renders each prompt with the tokenizer's chat template at construction (the same
``ChatFormat.prompt_ids`` the agent loop uses, so ``raw_prompt_ids`` match rollouts token for
token), and drops or truncates prompts over ``max_prompt_length``.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from skip_core.config import ConfigError
from skip_core.progress import progress

from skip_plugin_trainer.config.sections import DataConfig
from skip_plugin_trainer.data.chat import ChatFormat
from skip_plugin_trainer.data.custom import custom_rows
from skip_plugin_trainer.data.rows import data_files, messages, read_rows, tools_kwargs

logger = logging.getLogger(__name__)


class RLDataset(torch.utils.data.Dataset):
    """Prompts of one split, tokenized and length-checked up front.

    ``tools_schemas`` maps tool names to OpenAI function schemas; a row's prompt is rendered
    with the schemas of the tools its ``extra_info.tools_kwargs`` names, in that order (as the
    agent loop does). ``None`` renders no tools. ``files_key`` names the config key the files
    came from in error messages (``data.val_files`` for a validation set). Tokenizing, the slow
    part (minutes for a million rows), shows its progress.

    ``dropped`` counts the prompts filtered out for length (also logged at INFO).
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        config: DataConfig,
        tools_schemas: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        files_key: str = "data.train_files",
    ) -> None:
        self.config = config
        self.tools_schemas = tools_schemas
        self.pad_token_id = _pad_token_id(tokenizer)
        self._chat = ChatFormat(tokenizer, config.apply_chat_template_kwargs)
        if config.custom_cls.path is None:
            rows = read_rows(data_files(files, files_key))
        else:
            rows = custom_rows(files, tokenizer, config, files_key)
        if not rows:
            raise ConfigError(f"{files_key}: the files hold no rows")
        wheres, records, prompts = [], [], []
        with progress(len(rows), f"tokenizing {files_key}", "rows") as advance:
            for number, (where, row) in enumerate(rows):
                record, ids = self._prepare(where, row, number)
                wheres.append(where)
                records.append(record)
                prompts.append(ids)
                advance()
        self._keep(wheres, records, prompts)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """One prompt, left-padded to ``max_prompt_length``; non-tensor values are fresh copies."""
        i = range(len(self))[i]  # negative indices count from the end; out of range raises IndexError
        ids = self._ids[self._offsets[i] : self._offsets[i + 1]]
        width = self.config.max_prompt_length
        input_ids = torch.full((width,), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(width, dtype=torch.long)
        if len(ids):
            input_ids[-len(ids) :] = torch.from_numpy(ids)
            attention_mask[-len(ids) :] = 1
        item = copy.deepcopy(self._records[i])
        item["ground_truth"] = item["reward_model"].get("ground_truth")
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": torch.clip(torch.cumsum(attention_mask, dim=0) - 1, min=0),
            "raw_prompt_ids": ids.tolist(),
            **item,
        }

    def reward_inputs(self) -> Iterator[tuple[str, Any, Any]]:
        """Each row's file and row (or line), ``data_source`` and ``reward_model.ground_truth``:
        what the reward function will be given, for the checks before step 1."""
        for where, record in zip(self._wheres, self._records, strict=True):
            yield where, record["data_source"], record["reward_model"].get("ground_truth")

    def _prepare(self, where: str, row: Any, number: int) -> tuple[dict[str, Any], list[int]]:
        """The fields ``__getitem__`` returns (bar tensors) and the untruncated prompt ids of one row."""
        if not isinstance(row, Mapping):
            raise ConfigError(f"{where}: expected an object of columns, got {type(row).__name__}")
        chat = messages(row, self.config.prompt_key, where)
        for media in ("images", "videos"):  # verl's data.image_key / video_key, at their defaults
            if row.get(media) is not None and len(row[media]):
                raise ConfigError(f"{where}: the row has {media}; skip reads text prompts only")
        extra_info = dict(row.get("extra_info") or {})
        tools = tools_kwargs(extra_info.get("tools_kwargs"))
        record = {
            "raw_prompt": chat,
            "data_source": row.get("data_source"),
            "reward_model": dict(row.get("reward_model") or {}),
            "extra_info": extra_info,
            "index": number if extra_info.get("index") is None else extra_info["index"],
            "tools_kwargs": tools,
        }
        return record, self._chat.prompt_ids(chat, self._schemas(tools, where))

    def _schemas(self, tools_kwargs: Mapping[str, Any], where: str) -> list[Mapping[str, Any]] | None:
        if self.tools_schemas is None:
            return None
        unknown = [name for name in tools_kwargs if name not in self.tools_schemas]
        if unknown:
            have = ", ".join(sorted(self.tools_schemas)) or "none"
            raise ConfigError(
                f"{where}: extra_info.tools_kwargs names tool {unknown[0]!r}, which is not configured (tools: {have})"
            )
        return [self.tools_schemas[name] for name in tools_kwargs]

    def _keep(self, wheres: list[str], records: list[dict[str, Any]], prompts: list[list[int]]) -> None:
        """Drop or truncate prompts over the limit and pack the ids of the rest into one array."""
        limit = self.config.max_prompt_length
        lengths = [len(ids) for ids in prompts]
        if self.config.filter_overlong_prompts:
            kept = [i for i, n in enumerate(lengths) if n <= limit]
            if not kept:
                raise ConfigError(
                    f"data.max_prompt_length: all {len(lengths)} prompts are longer than {limit} tokens "
                    f"(shortest {min(lengths)}, longest {max(lengths)})"
                )
            self.dropped = len(lengths) - len(kept)
            if self.dropped:
                logger.info("dropped %d of %d prompts longer than %d tokens", self.dropped, len(lengths), limit)
        else:
            kept = range(len(prompts))
            self.dropped = 0
        truncated = [truncate(prompts[i], limit, self.config.truncation, wheres[i]) for i in kept]
        self._records = [records[i] for i in kept]
        self._wheres = [wheres[i] for i in kept]
        # One flat array instead of a list per prompt: a large dataset's ids stay compact.
        self._offsets = np.cumsum([0, *map(len, truncated)])
        self._ids = np.fromiter(itertools.chain.from_iterable(truncated), dtype=np.int64, count=self._offsets[-1])


def truncate(ids: list[int], limit: int, mode: str, where: str = "prompt") -> list[int]:
    """Fit ``ids`` into ``limit`` tokens: keep the end (left), the start (right), or both halves (middle)."""
    if len(ids) <= limit:
        return ids
    if mode == "left":
        return ids[-limit:]
    if mode == "right":
        return ids[:limit]
    if mode == "middle":
        head = limit // 2
        return ids[:head] + ids[len(ids) - (limit - head) :]
    raise ConfigError(
        f"{where}: the prompt has {len(ids)} tokens, more than data.max_prompt_length={limit}, "
        "and data.truncation is 'error' (set data.filter_overlong_prompts=true or data.truncation to left, right "
        "or middle)"
    )


def _pad_token_id(tokenizer: Any) -> int:
    """The pad id, else the end-of-sequence id (many chat tokenizers have no pad token)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    raise ConfigError(f"tokenizer {type(tokenizer).__name__} has neither a pad nor an end-of-sequence token")
