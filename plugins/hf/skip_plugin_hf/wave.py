"""One wave: the device state of a batch of rows decoded together, from prefill to the last token."""

from __future__ import annotations

import inspect
import random
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from skip_core.backend import SamplingParams
from transformers import PreTrainedModel

from skip_plugin_hf.sampling import Sampler


class Wave:
    """Left-padded prompts, their attention mask and positions, the KV cache and the sampler.

    Left padding puts every row's newest token in the last column; the mask hides the pads and
    positions count real tokens only, so each row computes what it would compute alone (up to
    floating-point summation order). Every method runs on the engine's worker thread.
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
        # Only the last position's logits are needed; a full [rows, width, vocab] prefill can be gigabytes.
        keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.forward_options = {"logits_to_keep": 1} if keeps_logits else {}

    @torch.inference_mode()
    def step(self) -> tuple[list[int], list[float]]:
        """One forward pass (the prefill on the first call); one sampled token and its log-prob per row."""
        out = self.model(
            input_ids=self.input_ids,
            attention_mask=self.attention_mask,
            position_ids=self.position_ids,
            past_key_values=self.cache,
            use_cache=True,
            **self.forward_options,
        )
        self.cache = out.past_key_values
        tokens, logprobs = self.sampler(out.logits[:, -1])
        self.input_ids = tokens[:, None]
        self.position_ids = self.position_ids[:, -1:] + 1
        self.attention_mask = F.pad(self.attention_mask, (0, 1), value=1)
        return tokens.tolist(), logprobs.tolist()

    @torch.inference_mode()
    def select(self, keep: Sequence[int]) -> None:
        """Drop the other rows from the batch and the cache, so finished rows stop costing compute."""
        rows = torch.tensor(keep, device=self.device)
        self.cache.batch_select_indices(rows)
        self.input_ids, self.position_ids = self.input_ids[rows], self.position_ids[rows]
        self.attention_mask = self.attention_mask[rows]
        self.sampler.select(rows, keep)
