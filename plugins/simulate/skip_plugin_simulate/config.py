"""What ``skip simulate`` models, validated once: every assumption is a key a preset states.

Times are seconds of virtual time. The run's own keys are verl's (``data.train_batch_size``,
``rollout.n``, ``actor.ppo_mini_batch_size``, ``trainer.total_training_steps``); a schedule's
settings are its own section (``async_training.*``), validated by the plugin that declares it.
"""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Requests(_Model):
    """Tokens each sample generates: log-normal around ``response_median``, capped at
    ``max_response_length``. A prompt's own difficulty (``prompt_sigma``) scales all its samples
    alike, as a hard problem lengthens every answer to it; ``sample_sigma`` spreads them."""

    prompt_tokens: PositiveInt = 512
    response_median: PositiveFloat = 1000.0
    prompt_sigma: NonNegativeFloat = 0.5
    sample_sigma: NonNegativeFloat = 0.5
    max_response_length: PositiveInt = 8192
    turns: PositiveInt = 1  # the response split evenly into this many turns
    tool_tokens: NonNegativeInt = 0  # a tool response's tokens, prefilled before the next turn
    tool_s: NonNegativeFloat = 0.0  # a tool call's latency


class Engines(_Model):
    """One rollout engine with continuous batching (fit ``decode_s`` and ``decode_s_per_row``
    from decode steps measured at several batch sizes)."""

    devices_per_engine: PositiveInt = 1
    decode_s: NonNegativeFloat = 0.02  # a decode step's time with no rows
    decode_s_per_row: NonNegativeFloat = 0.0001  # what each running row adds to it
    prefill_s_per_token: NonNegativeFloat = 0.00002
    max_batch: PositiveInt = 256

    @model_validator(mode="after")
    def _decoding_takes_time(self) -> Engines:
        if self.decode_s + self.decode_s_per_row <= 0:
            raise ValueError("decode_s or decode_s_per_row must be above 0: a decode step takes time")
        return self


class Trainer(_Model):
    """A training step (log-probs, reference, update) costs ``s_per_token`` per token of prompt
    and response on one device, divided over the trainer's devices, plus ``fixed_s``."""

    s_per_token: NonNegativeFloat = 0.0005
    fixed_s: NonNegativeFloat = 1.0


class WeightSync(_Model):
    """A weight push: ``fixed_s`` plus ``s_per_billion_params`` for a model of ``params_billion``.
    ``colocated_switch_s`` is what a colocated (``sync``) step adds to switch the devices
    between training and generation (offload and reload)."""

    params_billion: PositiveFloat = 7.0
    fixed_s: NonNegativeFloat = 0.1
    s_per_billion_params: NonNegativeFloat = 0.05
    colocated_switch_s: NonNegativeFloat = 0.0

    @property
    def seconds(self) -> float:
        return self.fixed_s + self.s_per_billion_params * self.params_billion


class Cluster(_Model):
    """``devices`` in all. An overlapped schedule gives ``rollout_devices`` to the engines and
    the rest to the trainer. ``sync`` generates and then trains on all of them when
    ``colocated`` (verl's colocated trainer); otherwise it keeps the split and takes turns
    (skip's own trainer on CPU, whose pools are disjoint under every schedule)."""

    devices: PositiveInt = 16
    rollout_devices: PositiveInt = 8
    colocated: bool = True


class Data(_Model):
    train_batch_size: PositiveInt = 64
    prompts: PositiveInt = 100_000  # in the dataset: an epoch
    val_prompts: NonNegativeInt = 0  # validated every trainer.test_freq steps, val_n samples each


class RolloutKeys(_Model):
    n: PositiveInt = 8
    val_n: PositiveInt = 1


class ActorKeys(_Model):
    ppo_mini_batch_size: PositiveInt = 16


class TrainerKeys(_Model):
    total_training_steps: PositiveInt = 100
    save_freq: int = -1  # a simulated checkpoint (kept in memory) every this many steps
    test_freq: int = -1  # validation after the update of every this many steps, and of the last
    seed: int = 1


class Published(_Model):
    """What a paper or a project's docs reported for the scenario a preset models, printed next
    to the prediction: throughput of each schedule against ``baseline``'s."""

    source: str
    baseline: str = "sync"
    speedup: dict[str, float] = {}


class Simulation(_Model):
    """A whole ``skip simulate`` config, bar the schedules' own sections."""

    published: Published | None = None

    requests: Requests = Requests()
    engines: Engines = Engines()
    training: Trainer = Trainer()
    weight_sync: WeightSync = WeightSync()
    cluster: Cluster = Cluster()
    data: Data = Data()
    rollout: RolloutKeys = RolloutKeys()
    actor: ActorKeys = ActorKeys()
    trainer: TrainerKeys = TrainerKeys()
