"""The ``profiling`` config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveFloat


class ProfilingConfig(BaseModel):
    """``profiling``: off by default; ``steps`` empty records every trainer step (and validation)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    enable: bool = False
    dir: str = "./runs/profile"
    steps: list[NonNegativeInt] = []
    flush_interval_s: PositiveFloat = 1.0
