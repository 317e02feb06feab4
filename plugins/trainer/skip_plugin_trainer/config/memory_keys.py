"""The checks of the keys that decide whether a run fits its devices, before anything starts:
each token budget must hold the longest sample, FSDP2's offload needs a sharded model, the
offload keys move nothing on the CPU (said once, naming the device, as verl's GPU keys are), and
FlashAttention's kernels run on a GPU only."""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any

from skip_core.config import ConfigError

from skip_plugin_trainer.config.algorithm import OFFLOAD_KEYS

if TYPE_CHECKING:
    from skip_plugin_trainer.config.sections import DataConfig


def check_budgets(name: str, model: Any, data: DataConfig) -> None:
    """``model``'s (an actor or critic config) budgets in use against the longest sample."""
    longest = data.max_prompt_length + data.max_response_length
    for key, budget in model.budgets().items():
        if budget < longest:  # verl asserts it too, at the first micro-batch
            raise ConfigError(
                f"{name}.{key}: {budget} tokens cannot hold one sample of data.max_prompt_length + "
                f"data.max_response_length = {longest}"
            )


def check_offloads(settings: Any) -> str | None:
    """``settings``' (a ``RunSettings``) offload keys: FSDP2's on one rank is refused; on the CPU,
    the warning that names those set (None: nothing to say). FlashAttention on the CPU is refused."""
    keys = [f"{name}.fsdp_config.{key}" for name in ("actor", "critic") for key in OFFLOAD_KEYS]
    offloads = [key for key in [*keys, "actor.ref_param_offload"] if attrgetter(key)(settings)]
    policy = next((key for key in offloads if key.endswith("offload_policy")), None)
    if policy and settings.resources.actor.workers == 1:
        raise ConfigError(
            f"{policy}: FSDP2's offload needs resources.actor.workers > 1 (one rank is not sharded); "
            "use param_offload and optimizer_offload"
        )
    attention = settings.model.attn_implementation
    if attention and attention.startswith("flash_attention") and settings.device == "cpu":
        raise ConfigError(
            f"{settings.resolved.written('model.attn_implementation')}: {attention} runs on a GPU only "
            "(trainer.device=cpu here); use sdpa or eager"
        )
    if offloads and settings.device == "cpu":
        written = ", ".join(settings.resolved.written(key) for key in offloads)
        return f"{written}: unused on trainer.device=cpu (they move tensors off a GPU)"
    return None
