"""The memory one actor rank needs at the peak of an update, estimated from the model's
``config.json`` and the run's settings before anything is loaded (``skip run --check``).

The parts: the master weights, their gradients and AdamW's two moments (each split over the
ranks), the reference and a distillation teacher in the compute dtype, the weights in the compute
dtype a rank holds whole for a while (FSDP2's gathered units, or autocast's cached copies on one
rank), the activations kept for the backward pass of the largest micro-batch, and the logits with
their float32 copies.
The critic of GAE shares the actor's device and adds its own state. Activation bytes per token
and layer are fitted to what ``saved_tensors_hooks`` counts on this project's CPU for a Llama/Qwen
decoder layer with ``sdpa`` (no [sequence x sequence] scores); docs/gpus.md states the error
against measured peaks. Nothing of the allocator's slack, the CUDA context or NCCL's buffers is in
it: those are the margin a user keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skip_plugin_trainer import model_files

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
KNOWN = ("llama", "qwen2", "qwen3", "mistral")
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class Shape:
    """A decoder-only model's shape, from its ``config.json``."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool

    @classmethod
    def read(cls, model_dir: str | Path) -> Shape:
        """``ValueError`` naming what the estimate cannot read."""
        config = model_files.read_json(model_dir, "config.json", MAX_CONFIG_BYTES)
        if not isinstance(config, dict):
            raise ValueError("config.json is not an object")
        kind = config.get("model_type")
        if kind not in KNOWN:
            raise ValueError(f"model_type {kind!r}: the estimate knows {', '.join(KNOWN)}")
        sizes = {}
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads"):
            value = config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 1 << 40:
                raise ValueError(f"config.json's {key} is {value!r}, not a positive integer")
            sizes[key] = value
        heads = sizes["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or sizes["hidden_size"] // heads
        if not all(isinstance(v, int) and v > 0 for v in (kv_heads, head_dim)):
            raise ValueError("config.json's num_key_value_heads or head_dim is not a positive integer")
        return cls(
            vocab=sizes["vocab_size"],
            hidden=sizes["hidden_size"],
            layers=sizes["num_hidden_layers"],
            intermediate=sizes["intermediate_size"],
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(config.get("attention_bias", False)),
            o_bias=kind != "qwen2" and bool(config.get("attention_bias", False)),
            qk_norm=kind == "qwen3",
        )

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0) + (h if self.o_bias else 0)
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return attention + 3 * h * self.intermediate + norms

    @property
    def root_params(self) -> int:
        """The embedding, the head when it is not tied to it, the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    def activation_bytes(self, compute: str, mixed_on_one_rank: bool) -> float:
        """Bytes one token keeps for the backward pass in one decoder layer (fitted: see the docstring)."""
        h, i, kv = self.hidden, self.intermediate, self.kv_heads * self.head_dim
        if mixed_on_one_rank:  # autocast: float32 residual stream and norms, bfloat16 matmuls
            return 53 * h + 14 * i + 8 * kv
        if compute == "bfloat16":
            return 20 * h + 8 * i + 4 * kv + 6 * self.heads
        return 32 * h + 16 * i + 8 * kv + 4 * self.heads


@dataclass(frozen=True)
class Plan:
    """What one rank of a trained model does, as the estimate needs it."""

    ranks: int
    master: str
    compute: str
    trainable: bool  # every weight trains (False: LoRA, whose adapters are negligible here)
    reference: bool
    checkpointing: bool
    tokens: int  # of the largest micro-batch, padding included
    responses: int  # of those, the response positions whose log-probs are taken
    chunk: int | None
    entropy: bool
    head: bool = True  # a language-model head (the critic's has one output: no logits to speak of)
    teacher: int = 0  # a distillation teacher's parameters: frozen, in the compute dtype, sharded as the reference is
    parked: tuple[str, ...] = ()  # the parts offloaded to the host between calls


def estimate(shape: Shape, plan: Plan) -> dict[str, float]:
    """Bytes per rank by part, at the update's peak: the state, what a rank holds whole, and the
    larger of the backward pass's working set (activations, logits) and the optimizer step's
    temporaries or a sharded embedding's unit (``step``: what they need beyond that set)."""
    m, c = DTYPE_BYTES[plan.master], DTYPE_BYTES[plan.compute]
    share = shape.params / plan.ranks
    parts = {"weights": share * m}
    parts["gradients"] = share * m if plan.trainable else 0.0
    parts["AdamW"] = 2 * share * m if plan.trainable else 0.0
    parts["reference"] = share * c if plan.reference else 0.0
    parts["teacher"] = plan.teacher / plan.ranks * c
    mixed = plan.compute != plan.master
    # sharded, an embedding no head shares is a unit of its own (``distributed.shard``), gathered with
    # its gradient only at the ends of the pass, when activations and logits are gone
    embedding = shape.vocab * shape.hidden * (c + 4) if plan.ranks > 1 and not (shape.tied and plan.head) else 0.0
    if plan.ranks > 1:  # the root unit (the head, the final norm) through the pass, two layer units (one
        # prefetched), their gradients unsharded
        root = shape.vocab * shape.hidden * plan.head + shape.hidden
        parts["gathered"] = root * (c + 4) + 2 * shape.layer_params * (c + 4)
    else:  # autocast's copies kept for the backward pass (a layer's at a time, checkpointed); the head's
        # fresh gradient before it is added to the accumulated one
        copied = shape.layer_params + shape.root_params if plan.checkpointing else shape.params
        parts["gathered"] = (copied * c if mixed else 0.0) + (shape.root_params * m if plan.trainable else 0.0)
    per_layer = shape.activation_bytes(plan.compute, mixed and plan.ranks == 1) * plan.tokens
    residual = 4 if mixed and plan.ranks == 1 else c
    if plan.checkpointing:  # each layer's input, and one layer recomputed at a time
        parts["activations"] = shape.layers * shape.hidden * residual * plan.tokens + per_layer
    else:
        parts["activations"] = shape.layers * per_layer
    parts["logits"] = 0.0
    if plan.head:  # the logits and their gradient in the compute dtype; float32 copies of the response's part
        copies = (1 if c == 4 else 2) + (1 if plan.entropy else 0) + 1  # (cast,) scaled, (softmax,) their gradient
        parts["logits"] = 2 * plan.tokens * shape.vocab * c + (plan.chunk or plan.responses) * shape.vocab * 4 * copies
    temporaries = share * m if plan.trainable else 0.0  # AdamW's foreach step holds a tensor of its share
    parts["step"] = max(0.0, max(temporaries, embedding) - parts["activations"] - parts["logits"])
    return parts


STATE = ("weights", "gradients", "AdamW", "reference", "teacher")


def resident(parts: dict[str, float], plan: Plan) -> float:
    """What stays on the device between updates (while a colocated engine generates)."""
    return sum(parts[key] for key in STATE if key not in plan.parked)


def parked(fsdp: Any, reference_offload: bool, colocated: bool = False) -> tuple[str, ...]:
    """The parts ``fsdp_config`` (and the reference's key) keep on the host between calls; all
    of them when ``colocated`` (``TrainedModel._setup``). A teacher waits where the reference does."""
    keys = ("weights", "gradients") if fsdp.param_offload or fsdp.offload_policy or colocated else ()
    keys += ("AdamW",) if fsdp.optimizer_offload or fsdp.offload_policy or colocated else ()
    return keys + (("reference", "teacher") if reference_offload or colocated else ())


def read_plans(settings: Any) -> dict[str, tuple[Shape, Plan]]:
    """The actor's (and the critic's, with GAE) shape and plan under ``settings`` (a ``RunSettings``)."""
    shape = Shape.read(settings.model_path())
    teacher = _teacher_params(settings.distillation.teacher_path)
    device, workers = settings.device, settings.resources.actor.workers
    longest = settings.data.max_prompt_length + settings.data.max_response_length
    plans = {}
    models = [("actor", settings.actor)] + ([("critic", settings.critic)] if settings.use_critic else [])
    for name, config in models:
        rows = config.ppo_micro_batch_size
        if config.use_dynamic_bsz:  # as many of the longest samples as the budget holds
            rows = max(1, config.ppo_max_token_len_per_gpu // longest)
        actor = name == "actor"
        plans[name] = (
            shape,
            Plan(
                ranks=workers,
                master=config.fsdp_config.model_dtype,
                compute=config.fsdp_config.compute(device),
                trainable=not (actor and settings.model.lora_rank > 0),
                reference=actor and settings.use_reference and settings.model.lora_rank == 0,
                checkpointing=(settings.model if actor else config).enable_gradient_checkpointing,
                tokens=rows * longest,
                responses=rows * settings.data.max_response_length,
                chunk=config.chunk if actor else None,
                entropy=actor and config.entropy_coeff != 0,
                head=actor,
                teacher=teacher if actor else 0,
                parked=parked(config.fsdp_config, actor and config.ref_param_offload, settings.resources.colocate),
            ),
        )
    return plans


def _teacher_params(path: str | None) -> int:
    """The distillation teacher's parameters (0 without one), from its ``config.json``."""
    if path is None:
        return 0
    try:
        return Shape.read(path).params
    except ValueError as exc:
        raise ValueError(f"the teacher's {exc}") from None


@dataclass(frozen=True)
class Summary:
    """The estimate as a table: a column per part, a row per trained model and, with two, their
    total (they share each rank's device, and update in turn); ``plans``: what was assumed."""

    headers: list[str]
    rows: list[list[str]]
    plans: dict[str, Plan]


def summary(settings: Any) -> Summary:
    plans = read_plans(settings)
    rows, parts = [], {}
    for name, (shape, plan) in plans.items():
        parts[name] = estimate(shape, plan)
        rows.append([name, *(gib(value) for value in parts[name].values()), gib(sum(parts[name].values()))])
    headers = ["model", *next(iter(parts.values())), "GiB"]
    if len(parts) > 1:  # both models' state, and the larger working set: they update in turn
        state = sum(parts[name][key] for name in parts for key in STATE)
        peak = max(sum(p.values()) - sum(p[key] for key in STATE) for p in parts.values()) + state
        rows.append(["both", *([""] * (len(headers) - 2)), gib(peak)])
    return Summary(headers, rows, {name: plan for name, (_, plan) in plans.items()})


def gib(value: float) -> str:
    """Bytes in GiB, to three significant digits."""
    return f"{value / GIB:.3g}"
