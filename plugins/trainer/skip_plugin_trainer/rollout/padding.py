"""Finished requests as one padded ``Batch``, in verl's layout.

Prompts are left-padded to ``prompt_length`` and responses right-padded to
``response_length``, so ``input_ids = prompts ++ responses`` lines up across samples.
``response_mask`` is the loss mask over responses: 1 for tokens the model sampled, 0 for
tool responses and padding. Position ids continue from the last prompt position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from skip_core.batch import Batch
from skip_core.layout import Column, Layout

#: What ``pad_requests`` returns: ``rollout.n`` samples per prompt, the prompt's columns
#: (``data.max_prompt_length``) and the response's (``data.max_response_length``). A cached
#: rollout that does not fit it is generated again, not loaded (``skip_core.layout``).
ROLLOUT_LAYOUT = Layout(
    {
        "prompts": Column("int64", "prompt"),
        "responses": Column("int64", "response"),
        "input_ids": Column("int64", "sequence"),
        "attention_mask": Column("int64", "sequence"),
        "position_ids": Column("int64", "sequence"),
        "response_mask": Column("int64", "response"),
        "rollout_log_probs": Column("float32", "response"),
    },
    per_prompt=True,
)


def pad_requests(requests: Sequence[Any], prompt_length: int, response_length: int, tokenizer: Any) -> Batch:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts, prompt_mask = _pad([r.prompt_ids for r in requests], prompt_length, pad, left=True)
    responses, response_attention = _pad([r.response_ids for r in requests], response_length, pad, left=False)
    response_mask, _ = _pad([r.response_mask for r in requests], response_length, 0, left=False)
    log_probs, _ = _pad([r.log_probs for r in requests], response_length, 0.0, left=False, dtype=torch.float32)
    prompt_positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
    response_positions = prompt_positions[:, -1:] + torch.arange(1, response_length + 1)
    return Batch.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_attention], dim=1),
            "position_ids": torch.cat([prompt_positions, response_positions], dim=1),
            "response_mask": response_mask,
            "rollout_log_probs": log_probs,
        },
        non_tensors={
            "messages": [r.messages for r in requests],
            "reward_scores": [dict(r.tool_rewards) for r in requests],
            "num_turns": np.array([r.turns for r in requests], dtype=np.int64),
            "tool_calls": np.array([r.tool_calls for r in requests], dtype=np.int64),
            "finish_reason": np.array([r.finish_reason for r in requests], dtype=object),
            # The weight versions a sample was generated with (several when a pause cut it).
            "min_weight_version": np.array([min(r.weight_versions, default=0) for r in requests], dtype=np.int64),
            "max_weight_version": np.array([max(r.weight_versions, default=0) for r in requests], dtype=np.int64),
            "interruptions": np.array([r.interruptions for r in requests], dtype=np.int64),
        },
    )


def _pad(rows: Sequence[Sequence], length: int, value: Any, left: bool, dtype=torch.long):
    """Rows as a (len(rows), length) tensor plus a mask of real entries; rows must fit."""
    out = torch.full((len(rows), length), value, dtype=dtype)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row) > length:
            raise ValueError(f"row {i} has {len(row)} entries, more than the padded length {length}")
        span = slice(length - len(row), length) if left else slice(0, len(row))
        out[i, span] = torch.tensor(row, dtype=dtype)
        mask[i, span] = 1
    return out, mask
