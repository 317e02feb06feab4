"""Prompts for RL training: verl-shaped rows read, rendered and batched.

``RLDataset`` reads rows shaped like verl's RLHFDataset input (``prompt`` chat messages,
``data_source``, ``reward_model.ground_truth``, ``extra_info.index`` / ``tools_kwargs``) from
parquet or JSON-lines files, renders each prompt with the tokenizer's chat template once at
construction (the same ``ChatFormat.prompt_ids`` the agent loop uses, so ``raw_prompt_ids``
match rollouts token for token), and drops or truncates prompts over ``max_prompt_length``.

``PromptLoader`` turns it into a resumable stream of ``Batch``es: the order of an epoch
depends only on (seed, epoch), so a loader restored from ``state_dict()`` yields exactly
the batches an uninterrupted run would have.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator
from skip_core.batch import Batch
from skip_core.config import ConfigError, to_container

from skip_plugin_trainer.rollout.chat import ChatFormat

logger = logging.getLogger(__name__)

SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}
# Tokenizing is the slow part of construction; below this many rows it takes a few seconds at most.
PROGRESS_ROWS = 10_000


class DataConfig(BaseModel):
    """The keys of verl's ``data`` section that shape prompts; other keys are left to their readers.

    Each field's description is what its error message says is allowed.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    train_files: list[StrictStr] = Field([], description="a list of parquet or JSON-lines files")
    val_files: list[StrictStr] = Field([], description="a list of parquet or JSON-lines files")
    prompt_key: StrictStr = Field("prompt", min_length=1, description="a non-empty column name")
    max_prompt_length: StrictInt = Field(gt=0, description="an integer > 0")
    max_response_length: StrictInt = Field(512, gt=0, description="an integer > 0")
    truncation: Literal["left", "right", "middle", "error"] = Field(
        "error", description="one of left, right, middle, error"
    )
    filter_overlong_prompts: StrictBool = Field(True, description="true or false")
    train_batch_size: StrictInt = Field(1024, gt=0, description="an integer > 0")
    shuffle: StrictBool = Field(True, description="true or false")
    seed: StrictInt = Field(0, ge=0, description="an integer >= 0")

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, (str, os.PathLike)) else value


def parse_data_config(raw: Any) -> DataConfig:
    """Validate the ``data`` section; a null value means the default, as it does in verl's YAML."""
    if isinstance(raw, DataConfig):
        return raw
    raw = to_container(raw)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"data: expected a mapping of settings, got {raw!r}")
    try:
        return DataConfig.model_validate({k: v for k, v in raw.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        name = error["loc"][0]
        allowed = DataConfig.model_fields[name].description
        if error["type"] == "missing":
            raise ConfigError(f"data.{name}: required, expected {allowed}") from None
        raise ConfigError(f"data.{name}: expected {allowed}, got {error['input']!r}") from None


class RLDataset(torch.utils.data.Dataset):
    """Prompts of one split, tokenized and length-checked up front.

    ``tools_schemas`` maps tool names to OpenAI function schemas; a row's prompt is rendered
    with the schemas of the tools its ``extra_info.tools_kwargs`` names, in that order (as the
    agent loop does). ``None`` renders no tools. ``files_key`` names the config key the files
    came from in error messages (``data.val_files`` for a validation set). ``progress`` shows a
    progress bar while tokenizing; by default only for more than ``PROGRESS_ROWS`` rows.

    ``dropped`` counts the prompts filtered out for length (also logged at INFO).
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        config: Any,
        tools_schemas: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        files_key: str = "data.train_files",
        progress: bool | None = None,
    ) -> None:
        self.config = parse_data_config(config)
        self.tools_schemas = tools_schemas
        self.pad_token_id = _pad_token_id(tokenizer)
        self._chat = ChatFormat(tokenizer)
        rows = _read_files(_file_list(files, files_key))
        if not rows:
            raise ConfigError(f"{files_key}: the files hold no rows")
        if len(rows) > PROGRESS_ROWS if progress is None else progress:
            from rich.progress import track

            rows = track(rows, description="Tokenizing prompts", total=len(rows))
        wheres, records, prompts = [], [], []
        for number, (where, row) in enumerate(rows):
            record, ids = self._prepare(where, row, number)
            wheres.append(where)
            records.append(record)
            prompts.append(ids)
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

    def _prepare(self, where: str, row: Any, number: int) -> tuple[dict[str, Any], list[int]]:
        """The fields ``__getitem__`` returns (bar tensors) and the untruncated prompt ids of one row."""
        if not isinstance(row, Mapping):
            raise ConfigError(f"{where}: expected an object of columns, got {type(row).__name__}")
        messages = _messages(row, self.config.prompt_key, where)
        extra_info = dict(row.get("extra_info") or {})
        tools_kwargs = _tools_kwargs(extra_info.get("tools_kwargs"))
        record = {
            "raw_prompt": messages,
            "data_source": row.get("data_source"),
            "reward_model": dict(row.get("reward_model") or {}),
            "extra_info": extra_info,
            "index": number if extra_info.get("index") is None else extra_info["index"],
            "tools_kwargs": tools_kwargs,
        }
        return record, self._chat.prompt_ids(messages, self._schemas(tools_kwargs, where))

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


def collate(items: Sequence[Mapping[str, Any]]) -> Batch:
    """Stack the tensors of dataset items; every other value becomes one entry of a 1-d object array."""
    if not items:
        raise ValueError("collate needs at least one item")
    first = items[0]
    tensors = {k: torch.stack([item[k] for item in items]) for k, v in first.items() if isinstance(v, torch.Tensor)}
    others = {k: [item[k] for item in items] for k, v in first.items() if not isinstance(v, torch.Tensor)}
    return Batch.from_dict(tensors, others)


class PromptLoader:
    """Batches of a dataset, epoch after epoch, resumable mid-epoch.

    The order of epoch ``e`` is ``numpy.random.default_rng([seed, e]).permutation(len(dataset))``
    (or dataset order without ``shuffle``): it depends on nothing else, so no generator state
    needs saving and NumPy guarantees the stream across versions.

    Two ways to drive it, sharing one position:

    - ``for batch in loader:`` yields the rest of the current epoch, then stops; a trainer runs
      ``for epoch in range(loader.epoch, total_epochs): for batch in loader: ...``.
    - ``next(loader)`` returns the next batch, going on into the next epoch without end.

    ``epoch`` and ``position`` always name the next batch: after the last batch of an epoch
    they read ``(epoch + 1, 0)``.
    """

    def __init__(
        self,
        dataset: RLDataset | Sequence[Mapping[str, Any]],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ConfigError(f"data.train_batch_size: expected an integer > 0, got {batch_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"data.seed: expected an integer >= 0, got {seed!r}")
        if drop_last and batch_size > len(dataset):
            raise ConfigError(
                f"data.train_batch_size: {batch_size} is more than the {len(dataset)} prompts of the dataset, "
                "so dropping the incomplete last batch leaves none"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._epoch = 0
        self._position = 0
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """Batches of the current epoch already handed out."""
        return self._position

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return len(self.dataset) // self.batch_size
        return math.ceil(len(self.dataset) / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        epoch = self._epoch
        while self._epoch == epoch:
            yield next(self)

    def __next__(self) -> Batch:
        start = self._position * self.batch_size
        batch = collate([self.dataset[int(i)] for i in self.order(self._epoch)[start : start + self.batch_size]])
        self._position += 1
        if self._position == len(self):
            self._epoch, self._position = self._epoch + 1, 0
        return batch

    def order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order epoch ``epoch`` visits them."""
        if self._order is None or self._order[0] != epoch:
            size = len(self.dataset)
            indices = np.random.default_rng([self.seed, epoch]).permutation(size) if self.shuffle else np.arange(size)
            self._order = (epoch, indices)
        return self._order[1]

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is, plus what must match for a resume to reproduce the order (JSON-able)."""
        return {"epoch": self._epoch, "position": self._position, **self._identity()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; the loader must be built with the same data and settings."""
        for key, mine in self._identity().items():
            if state.get(key) != mine:
                raise ConfigError(
                    f"cannot resume the prompt loader: the checkpoint has {key}={state.get(key)!r}, this run has "
                    f"{mine!r}; the remaining batches would differ from the interrupted run's"
                )
        epoch, position = state.get("epoch"), state.get("position")
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int) and 0 <= position < len(self)):
            raise ValueError(f"loader state: bad epoch {epoch!r} or position {position!r} (of {len(self)} batches)")
        self._epoch, self._position = epoch, position

    def _identity(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "dataset_size": len(self.dataset),
        }


def _file_list(files: Any, key: str) -> list[Path]:
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths = [Path(os.path.expanduser(os.fspath(f))) for f in files]
    if not paths:
        raise ConfigError(f"{key}: no files given")
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"{key}: no such file {str(path)!r}")
        if path.suffix.lower() not in SUFFIXES:
            allowed = ", ".join(SUFFIXES)
            raise ConfigError(f"{key}: {str(path)!r} is not a data file; expected a suffix of {allowed} (JSON lines)")
    return paths


def _read_files(paths: list[Path]) -> list[tuple[str, Any]]:
    """Rows of every file in order, each with where it came from for error messages."""
    rows = []
    for path in paths:
        read = _read_parquet if SUFFIXES[path.suffix.lower()] == "parquet" else _read_jsonl
        rows.extend(read(path))
    return rows


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    return [(f"{path}, row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}, line {number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}, line {number}: not JSON ({exc.msg}); expected an object a line") from None
    return rows


def _messages(row: Mapping[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    """The chat messages of a row, without the null fields parquet adds for keys other messages have."""
    if row.get(key) is None:
        columns = ", ".join(map(str, row)) or "none"
        raise ConfigError(f"{where}: no prompt column {key!r} (data.prompt_key); columns: {columns}")
    messages = row[key]
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) and "role" in m for m in messages):
        raise ConfigError(f"{where}: {key!r} must be a list of chat messages ({{role, content}}), got {messages!r}")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _tools_kwargs(value: Any) -> dict[str, dict[str, Any]]:
    """``extra_info.tools_kwargs`` without parquet's nulls.

    Parquet stores a mapping column as one struct for all rows, so a row reads back every tool
    and stage any row has, set to null where it had none. Those nulls are dropped: a null tool
    is not that row's tool, and a null stage has no arguments.
    """
    return {
        name: {stage: args for stage, args in (kwargs or {}).items() if args is not None}
        for name, kwargs in (value or {}).items()
        if kwargs is not None
    }


def _pad_token_id(tokenizer: Any) -> int:
    """The pad id, else the end-of-sequence id (many chat tokenizers have no pad token)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    raise ConfigError(f"tokenizer {type(tokenizer).__name__} has neither a pad nor an end-of-sequence token")
