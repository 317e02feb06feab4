"""verl's ``data.custom_cls``: the rows of the user's own dataset class.

The class is built as verl's ``create_rl_dataset`` builds it, ``cls(data_files=..., tokenizer=...,
processor=None, config=<the data section>, max_samples=-1)``, so a class written for verl
(a subclass of verl's ``RLHFDataset`` that maps another file layout into verl's rows, as the
ReTool recipe's does) plugs in unchanged. Its items are verl's rows: the chat under
``raw_prompt`` (what verl's agent loop renders) or ``data.prompt_key``, ``data_source``,
``reward_model`` and ``extra_info``. ``RLDataset`` renders and length-checks them as it does
rows read from files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from omegaconf import OmegaConf
from skip_core.config import ConfigError
from skip_core.escaping import printable

from skip_plugin_trainer import user_code
from skip_plugin_trainer.config.sections import CustomDataset, DataConfig

KEY = "data.custom_cls"


def custom_rows(
    files: str | os.PathLike | Sequence[str | os.PathLike], tokenizer: Any, config: DataConfig, files_key: str
) -> list[tuple[str, Any]]:
    """Every item of ``config.custom_cls`` built on ``files``, each named for error messages."""
    custom = config.custom_cls
    cls = dataset_class(custom)
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths = [os.path.expanduser(os.fspath(f)) for f in files]
    label = printable(custom.name)
    try:  # the user's code: whatever it raises is named in one line
        dataset = cls(
            data_files=paths,
            tokenizer=tokenizer,
            processor=None,
            config=OmegaConf.create(config.model_dump()),
            max_samples=-1,
        )
        count = len(dataset)
    except Exception as exc:
        raise ConfigError(f"{KEY}: building {label} on {files_key} failed: {user_code.described(exc)}") from None
    rows = []
    for i in range(count):
        where = f"{label}[{i}] ({files_key})"
        try:
            item = dataset[i]
        except Exception as exc:
            raise ConfigError(f"{KEY}: {where} failed: {user_code.described(exc)}") from None
        rows.append((where, _row(item, config.prompt_key)))
    return rows


def dataset_class(custom: CustomDataset) -> type[torch.utils.data.Dataset]:
    """The class ``custom`` names, checked to be a dataset as verl checks it."""
    cls = user_code.load_object(custom.path, custom.name, KEY)
    if not (isinstance(cls, type) and issubclass(cls, torch.utils.data.Dataset)):
        raise ConfigError(
            f"{KEY}.name: {printable(custom.name)!r} in {printable(custom.path)} is not a class deriving from "
            "torch.utils.data.Dataset, as verl requires"
        )
    return cls


def _row(item: Any, prompt_key: str) -> Any:
    """verl's row of one item: the chat its agent loop renders is ``raw_prompt`` where the item has one."""
    if not isinstance(item, Mapping) or item.get("raw_prompt") is None:
        return item
    return {**item, prompt_key: item["raw_prompt"]}
