"""The tiny model's warm-up: supervised steps on the assistant tokens of whole conversations,
built token for token as a rollout builds them (``skip_plugin_trainer.data.chat.ChatFormat``), with
its progress on a terminal or, elsewhere, as plain lines every few seconds (and in a log)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from itertools import groupby
from pathlib import Path
from typing import Any

from skip_core.progress import progress as skip_progress
from skip_plugin_trainer.data.chat import ChatFormat

Messages = Sequence[Mapping[str, Any]]


def conversation_ids(
    chat: ChatFormat, messages: Messages, tools: Sequence[Mapping[str, Any]]
) -> tuple[list[int], list[bool]]:
    """Token ids of a whole conversation as a rollout assembles them, and which ones the model sampled.

    The prompt is everything before the first assistant turn; later non-assistant messages
    are what the environment appends (tool responses), each run followed by the generation prompt.
    """
    ids: list[int] = []
    sampled: list[bool] = []
    for index, (by_model, group) in enumerate(groupby(messages, key=lambda m: m["role"] == "assistant")):
        group = list(group)
        if index == 0 and by_model:
            raise ValueError("a conversation must start with the prompt, not an assistant turn")
        if by_model:
            pieces = [chat.assistant_ids(message) for message in group]
        else:
            pieces = [chat.prompt_ids(group, tools) if index == 0 else chat.tool_response_ids(group)]
        for piece in pieces:
            ids += piece
            sampled += [by_model] * len(piece)
    return ids, sampled


def warm_up(
    model: Any,
    tokenizer: Any,
    conversations: Sequence[Messages],
    tools: Sequence[Mapping[str, Any]],
    steps: int,
    seed: int = 0,
    batch_size: int = 32,
    lr: float = 2e-3,
    progress: bool = True,
    log: Path | None = None,
    by_length: bool = False,
    label: str = "warm-up",
) -> list[float]:
    """Supervised steps on the assistant tokens of ``conversations``; returns the loss of each step.

    ``by_length`` batches conversations of similar lengths together (see ``_batches``): where a
    few are several times longer than the rest, a batch then pads to its own longest one, not
    to theirs, and the warm-up takes a fraction of the time.
    """
    import torch

    chat = ChatFormat(tokenizer)
    examples = [conversation_ids(chat, messages, tools) for messages in conversations[: steps * batch_size]]
    if steps and not examples:
        raise ValueError("a warm-up needs at least one conversation")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(steps))
    losses = []
    model.train()
    shown = skip_progress(steps, label, log=log) if progress else nullcontext(lambda count=1, note="": None)
    with shown as advance:
        lengths = [len(ids) for ids, _ in examples] if by_length else None
        for indices in _batches(len(examples), batch_size, steps, seed, lengths):
            loss = model(**_collate([examples[i] for i in indices], tokenizer.pad_token_id)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            advance(note=f"loss {losses[-1]:.3f}")
    model.eval()
    return losses


def _warmup_cosine(steps: int) -> Callable[[int], float]:
    """Linear warm-up over the first tenth, then a cosine down to a tenth of the rate."""
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return factor


def _batches(
    size: int, batch_size: int, steps: int, seed: int, lengths: Sequence[int] | None = None
) -> list[list[int]]:
    """``steps`` batches of indices, reshuffling each pass over the examples.

    With ``lengths``, every ``BUCKET`` consecutive batches trade examples so that each holds
    examples of similar lengths (sorted, cut into batches, the batches shuffled again): the same
    examples in the same stretch of steps, padded far less.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    flat: list[int] = []
    while len(flat) < steps * batch_size:
        flat += torch.randperm(size, generator=generator).tolist()
    batches = [flat[i * batch_size : (i + 1) * batch_size] for i in range(steps)]
    if lengths is None:
        return batches
    grouped = []
    for start in range(0, steps, BUCKET):
        bucket = sorted((i for batch in batches[start : start + BUCKET] for i in batch), key=lambda i: lengths[i])
        runs = [bucket[k : k + batch_size] for k in range(0, len(bucket), batch_size)]
        grouped += [runs[k] for k in torch.randperm(len(runs), generator=generator).tolist()]
    return grouped


BUCKET = 16
"""Batches whose examples ``_batches`` regroups by length."""


def _collate(examples: Sequence[tuple[list[int], list[bool]]], pad: int) -> dict[str, Any]:
    """Right-padded inputs whose labels keep only sampled tokens (-100 is ignored by the loss)."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad)
    labels = torch.full((len(examples), width), -100)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, sampled) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.where(torch.tensor(sampled), torch.tensor(ids), -100)
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
