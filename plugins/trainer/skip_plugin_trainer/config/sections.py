"""The sections of ``skip run`` and ``skip rollout`` besides the learning side's
(``algorithm.py``): ``task``, ``model``, ``data``, ``rollout``, ``trainer`` and
``resources``, with verl's key names. ``settings.py`` gathers them; this module imports nothing
else of the trainer.
"""

from __future__ import annotations

import errno
import os
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)


class Section(BaseModel):
    """Every section of the trainer's: an unknown key is an error, and a validated section is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


#: Bounds past which a value can only be a mistake: a seed numpy takes (below 2**32), a length
#: in tokens no model has (16M; a prompt of 1e18 tokens once tried to allocate 8e18 bytes), a
#: frequency of -1 (never) or more, a file name a filesystem takes (255 bytes a component).
MAX_SEED = 2**32 - 1
MAX_TOKENS = 2**24
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4095
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Tokens = Annotated[StrictInt, Field(gt=0, le=MAX_TOKENS)]
Frequency = Annotated[int, Field(ge=-1)]


def _name(value: str) -> str:
    """A name that becomes one path component (a directory, a cache namespace's part)."""
    if len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise ValueError(f"at most {MAX_NAME_BYTES} bytes, as a file name (this one has {len(value.encode())})")
    return value


def _path(value: str) -> str:
    """A path a filesystem takes: no component over 255 bytes, 4,095 in all, and no link on it
    that loops (it would fail far from here, as a traceback)."""
    encoded = value.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_PATH_BYTES or any(len(part) > MAX_NAME_BYTES for part in encoded.split(b"/")):
        raise ValueError(
            f"a path of at most {MAX_PATH_BYTES} bytes, each of its directories at most {MAX_NAME_BYTES} "
            f"(this one has {len(encoded)})"
        )
    try:
        os.path.realpath(os.path.expanduser(value), strict=True)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{value} goes through a symbolic link that loops ({exc.filename})") from None
    return value


Name = Annotated[str, AfterValidator(_name)]
LocalPath = Annotated[str, AfterValidator(_path)]
Attention = Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"]  # transformers' own


class TaskConfig(BaseModel):
    """``task``: a registered task that builds data (and a model) under ``dir``. The other keys are
    the task's options: its ``Task.Options``, a subclass of this model, validates them."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str | None = None
    dir: LocalPath = "runs/embedded"


class ModelConfig(BaseModel):
    """``model``: a local Hugging Face model directory (the task's, when a task builds one).

    ``lora_rank`` > 0 trains LoRA adapters (peft) on ``target_modules`` (peft's names, or
    ``all-linear``) minus ``exclude_modules``, scaled by ``lora_alpha`` / rank, instead of every
    weight of the policy: verl's keys and defaults. ``enable_gradient_checkpointing`` (verl's
    default on) recomputes each decoder layer's activations in the backward pass instead of keeping
    them. ``attn_implementation`` (verl's ``override_config.attn_implementation``): null takes
    ``flash_attention_2`` on a GPU where it is installed, ``sdpa`` otherwise (the FlashAttention
    kernels need ``trainer.device=cuda``: ``memory_keys``). ``override_config`` (verl's): entries
    of the model's Hugging Face config replaced for the policy, its reference, the critic and the
    rollout engines (each engine's own option: ``Backend.verl_keys``). verl's other ``model``
    keys are GPU tuning or refused (``verl_keys``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str | None = None
    lora_rank: NonNegativeInt = 0
    lora_alpha: PositiveFloat = 16
    target_modules: str | list[StrictStr] = "all-linear"
    exclude_modules: str | list[StrictStr] | None = None
    enable_gradient_checkpointing: StrictBool = True
    attn_implementation: Attention | None = None
    override_config: dict[str, Any] = {}


class CustomDataset(BaseModel):
    """``data.custom_cls``, verl's: the dataset class ``name`` of the Python file ``path``, built
    as verl builds it (``data/custom.py``). It is the user's own code, run because they named it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: StrictStr | None = None
    name: StrictStr | None = Field(None, validate_default=True)

    @field_validator("name")
    @classmethod
    def _named(cls, name: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("path") is not None and not name:
            raise ValueError("give the name of the dataset class in the file data.custom_cls.path names")
        return name


class DataConfig(BaseModel):
    """``data``: the keys of verl's ``data`` section that shape prompts (its others: ``verl_keys``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    train_files: list[StrictStr] = []
    val_files: list[StrictStr] = []
    prompt_key: StrictStr = Field("prompt", min_length=1)
    max_prompt_length: Tokens = 512
    max_response_length: Tokens = 512
    truncation: Literal["left", "right", "middle", "error"] = "error"
    filter_overlong_prompts: StrictBool = True
    train_batch_size: StrictInt = Field(1024, gt=0)
    # DAPO's: prompts each generation draws, when algorithm.filter_groups keeps train_batch_size of them
    gen_batch_size: StrictInt | None = Field(None, gt=0)
    # verl's: keyword arguments of every chat-template rendering (Qwen3's enable_thinking=false)
    apply_chat_template_kwargs: dict[StrictStr, Any] = {}
    shuffle: StrictBool = True
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] = 0
    custom_cls: CustomDataset = CustomDataset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, values: Any) -> Any:
        """verl's YAML writes null for "the default"."""
        return {k: v for k, v in values.items() if v is not None} if isinstance(values, dict) else values

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, (str, os.PathLike)) else value


class Sampling(Section):
    n: PositiveInt = 1
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)


class MultiTurn(Section):
    """``tools_config``: the tools YAML, a path (relative to the working directory) or
    ``pkg://<package>/<path>`` for one shipped inside an installed package. ``max_turns``: the
    assistant's turns (verl's ``max_assistant_turns``); ``max_user_turns`` (verl's): rounds of tool
    responses, after which a request ends (null: no limit), as verl's tool agent loop ends it."""

    max_turns: PositiveInt = 4
    max_user_turns: PositiveInt | None = None
    tools_config: str | None = None
    format: str = "hermes"
    tool_timeout_s: PositiveFloat = 30.0


class RolloutConfig(Sampling):
    """``rollout``: the backend, sampling and the agent loop. The backend's own options are
    sections of their own, nested here (``rollout.hf``, ``rollout.engine_kwargs.vllm``).

    ``seed`` makes rollouts reproducible: each turn of each request samples with a seed derived
    from (seed, step, prompt index, sample offset, turn). ``timeout_s`` bounds one engine call.
    ``val_kwargs`` replaces the sampling settings for validation.
    """

    backend: str = "hf"
    max_model_len: Tokens | None = None
    seed: Seed | None = 0
    timeout_s: PositiveFloat = 600.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    multi_turn: MultiTurn = MultiTurn()
    val_kwargs: Sampling = Sampling(temperature=0.0)
    # A weight sync sends the model in buckets of this many MiB (verl's key): each side holds
    # about two at a time, not a second copy of the model.
    update_weights_bucket_megabytes: PositiveFloat = 512
    # How a sync reaches the engines: broadcast over a process group (NCCL on GPUs, gloo on CPUs)
    # or through Ray's object store; auto takes NCCL's group between GPUs, the object store on host memory.
    weight_sync: Literal["auto", "group", "object_store"] = "auto"


class LoopConfig(RolloutConfig):
    """What the agent loop reads: the ``rollout`` section plus the lengths ``data`` sets."""

    prompt_length: PositiveInt
    response_length: PositiveInt
    chat_template_kwargs: dict[str, Any] = {}  # data.apply_chat_template_kwargs

    @property
    def model_len(self) -> int:
        total = self.prompt_length + self.response_length
        return min(self.max_model_len or total, total)


class TrainerConfig(Section):
    """``trainer``: length of the run, its directory, checkpoints, validation and loggers."""

    project_name: Name = "skip"
    experiment_name: Name = "run"
    schedule: str = "sync"
    total_epochs: PositiveInt = 1
    total_training_steps: PositiveInt | None = None
    default_local_dir: LocalPath = "runs/train"
    save_freq: Frequency = -1  # -1 (or 0): never
    test_freq: Frequency = -1
    val_before_train: bool = False
    critic_warmup: NonNegativeInt = 0  # steps that train only the critic, the actor from this step on
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: LocalPath | None = None
    max_ckpt_to_keep: PositiveInt | None = None
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = ["console", "jsonl"]
    seed: Seed = 0
    # Where the policy and the critic train (verl's key): auto is cuda when resources.actor asks
    # for GPUs, cpu otherwise.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Each step's per-token tensors in {default_local_dir}/train_data/, for `skip diff` (slime's
    # --save-debug-train-data): about 40 bytes per response token per step.
    save_train_data: bool = False


class RolloutPool(Section):
    workers: PositiveInt = 1
    cpus_per_worker: PositiveFloat = 1
    gpus_per_worker: NonNegativeFloat = 0  # Ray shows a worker only the GPUs its bundle asked for
    max_restarts: NonNegativeInt = 3  # times Ray restarts a lost worker (killed, preempted, out of memory)
    # How long a lost worker may take to come back: placed again (on another node, if its own is
    # gone: an autoscaler may first add one) and its engine loaded. Past it the run stops.
    restart_timeout_s: PositiveFloat = 600
    # Custom resources each worker's bundle asks for besides its CPUs ({node_b: 1}): on a cluster,
    # the pool goes to the nodes started with them (ray start --resources). null: none.
    ray_resources: dict[StrictStr, PositiveFloat] | None = None


class ActorPool(Section):
    """The policy's ranks (and the critic's, beside them): ``workers`` Ray workers, one
    data-parallel rank each, sharing ``cpus`` and each with ``gpus_per_worker``."""

    workers: PositiveInt = 1
    cpus: PositiveFloat = 1
    gpus_per_worker: NonNegativeFloat = 0
    ray_resources: dict[StrictStr, PositiveFloat] | None = None  # as the rollout pool's


class Resources(Section):
    """``resources``: the local Ray's CPUs (``num_cpus``, ignored when joining ``RAY_ADDRESS``)
    and each pool's share. ``torch_threads`` sets every worker's intra-op threads; by default
    a worker of an overlapped schedule gets its own CPUs (every worker runs at the same time),
    and one of ``sync`` its share of both pools' CPUs among the workers that run beside it (the
    rollout workers together, then the actor alone)."""

    num_cpus: PositiveInt | None = None
    torch_threads: PositiveInt | None = None
    rollout: RolloutPool = RolloutPool()
    actor: ActorPool = ActorPool()
    # The rollout engines and the actor share their devices (verl's hybrid engine): the sync
    # schedule puts the engines to sleep (their weights and KV cache freed) while the actor trains.
    colocate: bool = False

    def threads(self, cpus: float, overlapped: bool, together: int = 1) -> int:
        """Threads of a worker with ``cpus`` of its own, one of ``together`` that run at once."""
        both = self.rollout.workers * self.rollout.cpus_per_worker + self.actor.cpus
        return self.torch_threads or max(1, int(cpus if overlapped else both / together))
