"""A tiny tool-using chat model built from scratch on the machine: tokenizer, weights, warm-up.

The default task must run offline and on a laptop CPU, so nothing is downloaded: a byte-level
BPE tokenizer is trained on the task's own rendered conversations, a Llama of about a million
parameters is initialised from a seed, and a short supervised warm-up teaches it the tool protocol.
The result is an ordinary Hugging Face model directory (safetensors, ``tokenizer.json``,
ChatML-style chat template with tools) that any backend, vLLM and SGLang included, can load.

Warm-up sequences are built with ``skip_plugin_trainer.data.chat.ChatFormat``, the same functions the agent
loop uses, so what the model learns matches what rollouts feed it token for token.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

from skip_core.files import apply_umask
from skip_plugin_trainer.data.chat import ChatFormat

from skip_plugin_arithmetic import leftovers

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Not special, so they survive ``skip_special_tokens=True`` and a tool-call parser sees them.
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
VOCAB_SIZE = 1024
# Task conversations repeat the same words: more of them add time, not tokens.
CORPUS_SIZE = 1000

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content ~ '\\n\\n' }}{%- endif %}"
    "{{- 'You can call these tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' ~ (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and tools and message.role == 'system') %}"
    "{{- '<|im_start|>' ~ message.role ~ '\\n' }}"
    "{%- if message.role == 'tool' %}"
    "{{- '<tool_response>' ~ message.content ~ '</tool_response>' }}"
    "{%- else %}"
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '<tool_call>{\"name\": ' ~ (fn.name | tojson) ~ ', \"arguments\": ' }}"
    "{{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML without a newline after ``<|im_end|>``: a conversation renders as the concatenation of
its turns, which ``ChatFormat`` needs, and the end-of-turn token is the last token sampled."""

Messages = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Stage:
    """A further warm-up of ``build``: ``steps`` steps on ``conversations`` with a fresh optimizer
    and learning-rate schedule, batched by length when ``by_length`` (see ``warm_up``)."""

    conversations: Sequence[Messages]
    steps: int
    by_length: bool = False
    label: str = "warm-up"


def build(
    target: Path,
    conversations: Sequence[Messages],
    tools: Sequence[Mapping[str, Any]],
    steps: int,
    seed: int = 0,
    progress: bool = True,
    log: Path | None = None,
    then: Sequence[Stage] = (),
) -> Path:
    """Build the tokenizer and model, warm them up on ``conversations`` (then on each of ``then``)
    and save them at ``target``. The tokenizer is trained on ``conversations`` alone, so a build
    with further stages starts as the build without them: the same model, warmed up further.

    Built in a fresh directory next to ``target`` and renamed into place, so a killed build
    never leaves a directory that looks complete. What a killed build leaves, a hidden
    ``.<name>.partial-<pid>@<host>-*``, the next build removes once its process is gone (and
    says so, on the terminal with ``progress`` and in ``log``).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    leftovers.say(leftovers.remove(directories=[target]), progress, log)
    tmp = leftovers.partial_directory(target)
    try:
        tokenizer = build_tokenizer(render(conversations[:CORPUS_SIZE], tools))
        model = build_model(tokenizer, seed)
        warm_up(model, tokenizer, conversations, tools, steps, seed=seed, progress=progress, log=log)
        for stage in then:
            warm_up(
                model,
                tokenizer,
                stage.conversations,
                tools,
                stage.steps,
                seed=seed,
                progress=progress,
                log=log,
                by_length=stage.by_length,
                label=stage.label,
            )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        apply_umask(tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish(tmp: Path, target: Path) -> None:
    try:
        os.rename(tmp, target)
    except OSError:
        # A concurrent build finished first: its model is as good as ours.
        if not target.is_dir():
            raise


def render(conversations: Iterable[Messages], tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """Conversations as the chat template writes them, the tokenizer's training corpus."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    # Rendering needs only the template, not a vocabulary, so an empty tokenizer carries it.
    chat = ChatFormat(PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=CHAT_TEMPLATE))
    return [chat.render(messages, tools, generate=False) for messages in conversations]


def build_tokenizer(corpus: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Any:
    """Byte-level BPE with one token per digit, wrapped as a ``PreTrainedTokenizerFast``.

    Single digits keep every number's tokens aligned with its digits, which is what copying
    a number (into a tool call, out of a tool response) needs. Text is not split into words,
    so the template's fixed phrases (the tool schema, ``{"name": "calculator", ...``) become
    a few tokens and sequences are about three times shorter, which is most of the warm-up's
    cost. A newline ends a piece, so ``assistant\n`` of a generation prompt never merges with
    what the model writes next: a conversation's ids stay the concatenation of its turns' ids.
    ``vocab_size`` is an upper bound; a repetitive corpus runs out of merges before it.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("\n", behavior="merged_with_previous"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The markers become single added tokens, so merges spent on their pieces would be wasted.
    markers = re.compile("|".join(re.escape(token) for token in (PAD, IM_START, IM_END, *TOOL_TAGS)))
    tokenizer.train_from_iterator((piece for text in corpus for piece in markers.split(text) if piece), trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )


def build_model(tokenizer: Any, seed: int) -> Any:
    """A two-layer Llama of about 1.1M parameters, randomly initialised from ``seed``.

    Shaped for what the warm-up must teach in a CPU minute, copying digits: two layers with
    eight narrow heads learned it several times faster than four layers, and a wider MLP
    only cost time.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    pad, end = tokenizer.pad_token_id, tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=end,
        pad_token_id=pad,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=end, pad_token_id=pad)
    return model


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
    with _progress(progress, steps, log, label) as advance:
        lengths = [len(ids) for ids, _ in examples] if by_length else None
        for indices in _batches(len(examples), batch_size, steps, seed, lengths):
            loss = model(**_collate([examples[i] for i in indices], tokenizer.pad_token_id)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            advance(losses[-1])
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


@contextmanager
def _progress(
    enabled: bool, steps: int, log: Path | None = None, label: str = "warm-up"
) -> Iterator[Callable[[float], None]]:
    """The warm-up's progress: a rich bar on a terminal; otherwise (CI, ``nohup``, a cluster log) a
    plain line every ``PROGRESS_EVERY_S`` seconds. The plain lines also go to ``log`` when given."""
    if not enabled:
        yield lambda loss: None
        return
    from rich.console import Console

    terminal = Console().is_terminal
    lines = _ProgressLines(steps, log, echo=not terminal, label=label)
    with _bar(steps, label) if terminal else nullcontext(lambda loss: None) as bar:

        def advance(loss: float) -> None:
            bar(loss)
            lines.advance(loss)

        yield advance
    lines.emit()


@contextmanager
def _bar(steps: int, label: str) -> Iterator[Callable[[float], None]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"))
    with Progress(*columns, TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task(label, total=steps, loss="-")
        yield lambda loss: bar.update(task, advance=1, loss=f"{loss:.3f}")


PROGRESS_EVERY_S = 10.0


class _ProgressLines:
    """``warm-up 120/350 steps, loss 1.234, 24 s elapsed, about 46 s left``, every few seconds."""

    def __init__(self, steps: int, log: Path | None, echo: bool, label: str = "warm-up") -> None:
        self.steps, self.log, self.echo, self.label = steps, log, echo, label
        self.done, self.loss = 0, float("nan")
        self.start = self.last = time.monotonic()

    def advance(self, loss: float) -> None:
        self.done, self.loss = self.done + 1, loss
        if time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.emit()

    def emit(self) -> None:
        self.last = time.monotonic()
        elapsed = self.last - self.start
        line = f"{self.label} {self.done}/{self.steps} steps, loss {self.loss:.3f}, {elapsed:.0f} s elapsed"
        if 0 < self.done < self.steps:
            line += f", about {elapsed / self.done * (self.steps - self.done):.0f} s left"
        if self.echo:
            print(line, flush=True)
        if self.log is not None:
            with open(self.log, "a", encoding="utf-8") as file:
                file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
