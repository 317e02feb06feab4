"""How a trained model computes, verl's way: master weights in ``fsdp_config.model_dtype``, forward
and backward in ``fsdp_config.dtype``, the attention kernel of the device, and train mode with
every dropout at zero so that gradient checkpointing recomputes without changing a result.

Sharded, the compute dtype is FSDP2's ``MixedPrecisionPolicy``: each layer's parameters are
gathered in it and gradients reduced in float32 into float32 shards, the optimizer's state is
float32. A single rank has no FSDP: autocast computes its matmuls in the compute dtype over the
float32 weights. The reference and other frozen copies are simply held in the compute dtype.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from skip_plugin_trainer.config.algorithm import FsdpConfig


@dataclass(frozen=True)
class Precision:
    master: torch.dtype
    compute: torch.dtype

    @classmethod
    def of(cls, config: FsdpConfig, device: str) -> Precision:
        return cls(getattr(torch, config.model_dtype), getattr(torch, config.compute(device)))

    @property
    def mixed(self) -> bool:
        return self.compute != self.master

    def sharding(self) -> torch.distributed.fsdp.MixedPrecisionPolicy | None:
        """What ``fully_shard`` takes: parameters in the compute dtype, reductions in float32."""
        if not self.mixed:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=torch.float32)

    @contextlib.contextmanager
    def autocast(self, device: torch.device, sharded: bool) -> Iterator[None]:
        """A single rank's mixed precision (FSDP's policy does it for a sharded model)."""
        if not self.mixed or sharded:
            yield
            return
        with torch.autocast(device.type, dtype=self.compute):
            yield


def attention(configured: str | None, device: str, compute: torch.dtype) -> str:
    """``model.attn_implementation``, or FlashAttention 2 on a GPU where it is installed and
    computes in 16 bits, ``sdpa`` otherwise."""
    if configured is not None:
        return configured
    if device == "cuda" and compute != torch.float32 and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def trainable(model: torch.nn.Module, checkpointing: bool) -> torch.nn.Module:
    """``model`` in train mode with no dropout anywhere (transformers' checkpointing recomputes
    only in train mode; dropout would make the result depend on it), checkpointing each decoder
    layer when asked (non-reentrant: no input needs a gradient, FSDP2 and LoRA allow it)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for holder in (module, getattr(module, "config", None)):
            for name, value in list(vars(holder).items()) if holder is not None else ():
                if "dropout" in name and isinstance(value, float):
                    setattr(holder, name, 0.0)  # attention dropout is a float the layer reads in train mode
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()
