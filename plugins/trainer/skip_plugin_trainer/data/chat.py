"""Token ids of a conversation, built turn by turn the way the agent loop sees it.

A multi-turn rollout never re-tokenizes what the model produced: the sampled ids are the
response. Only the pieces the environment adds (the prompt, tool responses, the next
generation prompt) are rendered with the tokenizer's chat template. Rendering a piece on its
own is done by rendering it after a fixed one-message prefix and keeping what follows the
prefix, which works for any template whose rendering of a conversation extends the rendering
of its beginning (ChatML, Qwen, Llama 3 ...); ``ChatFormat`` checks that and says so if not.

Supervised warm-up data built with ``assistant_ids`` therefore matches rollouts token for token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_PREFIX = [{"role": "user", "content": "x"}]


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot render conversation pieces incrementally."""


class ChatFormat:
    """``template_kwargs`` go to every rendering (verl's ``data.apply_chat_template_kwargs``,
    e.g. Qwen3's ``enable_thinking``), so prompts and tool responses render alike."""

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(f"tokenizer {type(tokenizer).__name__} has no chat template")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})

    def render(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None, generate: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=generate,
            tokenize=False,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None) -> list[int]:
        """The first prompt, ending with the generation prompt of the assistant's turn."""
        return self.encode(self.render(messages, tools))

    def tool_response_ids(self, tool_messages: Sequence[Mapping]) -> list[int]:
        """Tool responses appended after an assistant turn, then the next generation prompt."""
        return self.encode(self._after_prefix(self.render(_PREFIX, generate=False), [*_PREFIX, *tool_messages], True))

    def assistant_ids(self, message: Mapping) -> list[int]:
        """An assistant turn as the model generates it: up to and including the end-of-turn token.

        Whatever a template adds after that token (Qwen's newline) is never sampled, so it is
        not part of the turn.
        """
        ids = self.encode(self._after_prefix(self.render(_PREFIX), [*_PREFIX, message], False))
        end = self.tokenizer.eos_token_id
        return ids[: ids.index(end) + 1] if end in ids else ids

    def _after_prefix(self, prefix: str, messages: list[Mapping], generate: bool) -> str:
        full = self.render(messages, generate=generate)
        if not full.startswith(prefix):
            raise ChatTemplateError(
                "the chat template does not render a conversation as an extension of its beginning; "
                f"rendering {prefix!r} then more messages gave {full!r}"
            )
        return full[len(prefix) :]
