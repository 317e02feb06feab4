"""A tiny tool-using chat model built from scratch on the machine: tokenizer, weights, warm-up.

The default task must run offline and on a laptop CPU, so nothing is downloaded: a byte-level
BPE tokenizer is trained on the task's own rendered conversations, a Llama of about a million
parameters is initialised from a seed, and a short supervised warm-up teaches it the tool protocol.
The result is an ordinary Hugging Face model directory (safetensors, ``tokenizer.json``,
ChatML-style chat template with tools) that any backend, vLLM and SGLang included, can load.

The warm-up (``skip_plugin_arithmetic.warmup``) builds its sequences with the agent loop's own
``ChatFormat``, so what the model learns matches what rollouts feed it token for token.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skip_core.files import apply_umask
from skip_plugin_trainer.data.chat import ChatFormat

from skip_plugin_arithmetic import leftovers
from skip_plugin_arithmetic.warmup import Messages, warm_up

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


def llama(vocab_size: int, seed: int = 0, **config: Any) -> Any:
    """A ``LlamaForCausalLM`` randomly initialised from ``seed``: ``vocab_size`` tokens and
    ``config`` (``LlamaConfig``'s keys) over a small default shape (two layers of 64). The
    embedded model is one; the tests and benchmarks build theirs with it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **{**shape, "num_key_value_heads": 2, **config}))


def build_model(tokenizer: Any, seed: int) -> Any:
    """A two-layer Llama of about 1.1M parameters, randomly initialised from ``seed``.

    Shaped for what the warm-up must teach in a CPU minute, copying digits: two layers with
    eight narrow heads learned it several times faster than four layers, and a wider MLP
    only cost time.
    """
    from transformers import GenerationConfig

    pad, end = tokenizer.pad_token_id, tokenizer.eos_token_id
    shape = {"hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 8, "num_key_value_heads": 4}
    model = llama(
        len(tokenizer),
        seed,
        **shape,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=end,
        pad_token_id=pad,
    )
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=end, pad_token_id=pad)
    return model
