"""What a step expects of a cached result, checked before the result replaces a call.

A verified hash proves that an entry holds what was written, not that it fits the step that
loads it: an entry resealed with other dtypes or shapes, or written under other lengths, would
load and then crash the trainer deep in the reward or the loss, far from its cause. A decorated
function declares the layout of what it returns (``SkipManager.annotate(role, layout=...)``):
its tensors, their dtypes, and which length each one's last dimension has. A lookup checks an
entry's tensors against it from the safetensors header, before a byte of them is read, and an
entry that does not fit is a warning naming it and the mismatch, then a miss.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from skip_core.config import Namespace

Width = Literal["prompt", "response", "sequence"]
# safetensors' dtype names, as torch names them.
DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
           "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}  # fmt: skip


@dataclass(frozen=True)
class Column:
    """One tensor of a result: its torch dtype name (``"int64"``), the length its last dimension
    has (the prompt's, the response's, or both together), and whether every result holds it."""

    dtype: str
    width: Width | None = None
    required: bool = True


@dataclass(frozen=True)
class Layout:
    """The tensors a decorated function returns. ``per_prompt``: it returns ``n`` samples for each
    row of its input (a rollout, ``n`` from ``actor_rollout_ref.rollout.n``), else one per row."""

    tensors: Mapping[str, Column]
    per_prompt: bool = False

    def expect(self, inputs: Any, namespace: Namespace) -> Expected:
        """The numbers this call's result must have: samples from its inputs, lengths from the
        run's config (``data.max_prompt_length``, ``data.max_response_length``) or, for a phase
        after the rollout, from the responses it is given."""
        rows = _rows(inputs)
        widths: dict[str, int] = {}
        responses = getattr(inputs, "batch", None)
        responses = responses.get("responses") if isinstance(responses, Mapping) else None
        if not self.per_prompt and responses is not None and responses.dim() >= 2:
            widths["response"] = int(responses.shape[-1])
        elif self.per_prompt and namespace.response_len:
            widths["response"] = namespace.response_len
        if self.per_prompt and namespace.prompt_len:
            widths["prompt"] = namespace.prompt_len
        if "prompt" in widths and "response" in widths:
            widths["sequence"] = widths["prompt"] + widths["response"]
        if rows is None:
            samples, why = None, ""
        elif self.per_prompt:
            samples, why = rows * namespace.n, f"{rows} prompts x rollout.n={namespace.n}"
        else:
            samples, why = rows, "one per input sample"
        return Expected(self, samples, why, widths)


@dataclass(frozen=True)
class Expected:
    """A layout with this call's numbers: what ``problems`` holds an entry's tensors to."""

    layout: Layout
    samples: int | None
    samples_why: str
    widths: dict[str, int] = field(default_factory=dict)

    def problems(self, tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[str]:
        """What does not fit, in words, for tensors given as ``{name: (dtype, shape)}``; empty when all does."""
        found: list[str] = []
        seen = dict(self.widths)  # a width the config does not give is the first column's
        for name, column in self.layout.tensors.items():
            if name not in tensors:
                if column.required:
                    found.append(f"it lacks the tensor {name!r}")
                continue
            dtype, shape = tensors[name]
            if dtype != column.dtype:
                found.append(f"{name} is {dtype}, expected {column.dtype}")
            if column.width is not None and len(shape) >= 2:
                expected = seen.setdefault(column.width, shape[-1])
                if shape[-1] != expected:
                    found.append(f"{name} has {shape[-1]} columns, expected {expected} ({column.width} length)")
            elif column.width is not None:
                found.append(f"{name} has shape {list(shape)}, expected a row per sample")
        if self.samples is not None:
            for name, (_, shape) in tensors.items():
                if not shape or shape[0] != self.samples:
                    rows = shape[0] if shape else "no"
                    found.append(f"{name} has {rows} rows, expected {self.samples} ({self.samples_why})")
                    break
        return found


def header(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of a safetensors file, read from its header alone."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        tensors = {}
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            part = f.get_slice(name)
            tensors[name] = (DTYPES.get(part.get_dtype(), part.get_dtype()), tuple(part.get_shape()))
        return tensors


def _rows(inputs: Any) -> int | None:
    try:
        return len(inputs) if inputs is not None else None
    except TypeError:
        return None
