"""``HFOptions``, the options of the ``hf`` backend (its section ``rollout.hf``): pydantic only, so
listing plugins imports no torch."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PositiveInt


class HFOptions(BaseModel):
    """``rollout.hf``: where and how the model runs.

    ``device`` ``auto`` takes CUDA when torch sees it; ``dtype`` null is bfloat16 on CUDA and
    float32 on CPU; ``max_batch_size`` bounds the rows decoded together. ``batching``
    ``continuous`` lets rows join the running batch between two forward passes; ``wave`` only
    when it is empty (static batching: arrivals wait for the slowest row, kept for comparison).
    ``config_overrides``: entries of the model's config replaced (``model.override_config``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    max_batch_size: PositiveInt = 64
    batching: Literal["continuous", "wave"] = "continuous"
    config_overrides: dict[str, Any] = {}
