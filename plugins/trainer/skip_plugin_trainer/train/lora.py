"""LoRA on the policy (verl's ``model.lora_rank``): peft adapters on ``target_modules`` are all
the actor trains; the base weights stay frozen.

The rollout engines get the merged weights, ``W + scale x B @ A`` under the base model's own
names, computed afresh at each sync: merging into the base in place and unmerging afterwards
would move the frozen weights by a rounding error per sync. The reference policy (KL) is the
base model, the adapters disabled, as in verl. A checkpoint holds peft's state dict (base and
adapters under peft's names), so a resumed run continues the same adapters.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from skip_core.config import ConfigError

from skip_plugin_trainer.config.sections import ModelConfig
from skip_plugin_trainer.train.distributed import own_state

ADAPTER = "default"  # peft's name for the one adapter


def with_adapters(model: Any, settings: ModelConfig) -> Any:
    """``model`` wrapped by peft with trainable LoRA adapters (dropout 0, as verl sets it)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        target_modules=settings.target_modules,
        exclude_modules=settings.exclude_modules,
        lora_dropout=0.0,
        bias="none",
    )
    return get_peft_model(model, config)


def initial_adapters(model: Any, seed: int) -> dict[str, torch.Tensor]:
    """Each adapter's initial value, as peft draws it (A as ``nn.Linear`` would be, B zero; the
    other way round for an embedding), from ``seed`` alone and whole: a sharded policy, built on
    meta, starts from the same adapters as one rank."""
    generator = torch.Generator().manual_seed(seed)
    initial = {}
    for name, parameter in model.named_parameters():
        if ".lora_" not in name:
            continue
        value = torch.zeros(parameter.shape)
        if ".lora_A." in name:
            torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
        elif ".lora_embedding_B." in name:
            torch.nn.init.normal_(value, generator=generator)
        elif not (".lora_B." in name or ".lora_embedding_A." in name):
            raise ValueError(f"{name}: an adapter parameter skip does not initialise")
        initial[name] = value
    return initial


def base_name(name: str) -> str:
    """A parameter of the peft-wrapped model under the name the model's files give it."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The weights the adapters amount to, under the base model's names (what an engine loads),
    each tensor once (a tied head is the embedding's: ``own_state``; sharded, by parameter, as
    shards have no storage of their own to compare)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {
        f"{name}.base_layer.weight": module.get_delta_weight(ADAPTER)
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A
    }
    merged = {}
    for name, tensor in own_state(base).items():
        if ".lora_" in name:
            continue
        if name in deltas:
            tensor = tensor + deltas[name].to(tensor.dtype)
        merged[name.replace(".base_layer.", ".")] = tensor
    return merged


def check_targets(model_path: str, settings: ModelConfig) -> None:
    """Refuse, before any worker starts, ``target_modules`` / ``exclude_modules`` that select no
    layer of the model: adapters built on a weightless (meta) copy of its architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    try:
        with_adapters(model, settings)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError and its other refusals of the targets
        raise ConfigError(f"model.target_modules: {str(exc).splitlines()[0]}") from None


@contextlib.contextmanager
def base_only(model: Any) -> Iterator[Any]:
    """The base model's forward (the adapters off): verl's reference policy under LoRA."""
    with model.disable_adapter():
        yield model
