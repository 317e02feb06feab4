"""The rollout backend interface: an async, per-request generation engine.

A plugin declares a backend as one ``Backend`` (its name, options and config section) and
registers it through ``skip_register_backends``; ``rollout.backend=<name>`` picks one.
The agent loop sends one request per turn, many at once; a backend batches them itself.

Cancelling the task awaiting ``generate`` aborts that request: the agent loop relies on it
to enforce timeouts. Weights arrive in buckets (parts of the state dict, together the whole
model once), so neither side holds a second copy of the model; an engine that joins a process
group (``weight_group.py``) takes them as broadcasts instead. ``pause``/``resume`` let an
asynchronous schedule swap weights under requests in flight (partial rollout); a backend that
cannot says so when they are called.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from pydantic import BaseModel

from skip_core.config import ConfigError, lookup

if TYPE_CHECKING:  # torch is imported only where weights move
    from skip_core.weight_group import Layout, Receiver, WeightGroup


@dataclass(frozen=True)
class SamplingParams:
    """What to sample; ``temperature=0`` is greedy, ``top_k=-1`` and ``top_p=1`` disable filtering.

    ``seed`` makes a request reproducible: sample ``i`` of ``n`` draws from its own generator
    seeded from ``(seed, i)``, whatever else shares the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    seed: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        checks = {"temperature": self.temperature >= 0, "top_p": 0 < self.top_p <= 1, "n": self.n > 0}
        checks.update({"top_k": self.top_k == -1 or self.top_k > 0, "max_new_tokens": self.max_new_tokens > 0})
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SamplingParams.{name}: invalid value {getattr(self, name)!r}")


def logprob_temperature(temperature: float) -> float:
    """The temperature a sampled token's log-prob is taken at, by the engine that sampled it and by
    the trainer that recomputes it: the sampling temperature, and 1 for a greedy (0) sample, whose
    argmax has no distribution of its own."""
    return temperature or 1.0


#: Why a completion or a request ended: its stop token or string, its length budget, an engine
#: that stopped it early (``abort``: a pause or a shutdown; a completion only), or its turns
#: (``max_turns``: a multi-turn request of the agent loop only).
FinishReason = Literal["stop", "length", "abort", "max_turns"]


@dataclass(frozen=True)
class Generation:
    """One completion: the sampled token ids, the log-prob of each, and why it ended.

    ``log_probs[i]``: of ``token_ids[i]`` at the sampling temperature, before top-k/top-p (what
    the trainer recomputes). A completion ends with its stop token, or the token completing
    its stop string.
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason


class RolloutBackend(ABC):
    @abstractmethod
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str) -> list[Generation]:
        """Generate ``params.n`` completions of ``prompt_ids``."""

    @abstractmethod
    async def update_weights(self, buckets: AsyncIterable[Mapping[str, Any]]) -> None:
        """Load new policy weights from the trainer, in place, between forward passes: each
        bucket maps names to tensors, read once (the caller frees it when asked for the next)."""

    def receiver(self) -> Receiver | None:
        """How the engine takes weights over a process group (``weight_group.py``): its processes,
        dtype and device; None where it does not, and takes them through ``update_weights`` only."""
        return None

    async def join_weight_group(self, group: WeightGroup, rank_offset: int) -> None:
        """Join ``group``, the engine's processes as ranks ``rank_offset`` on (one per
        ``receiver().ranks``), leaving the group joined before; returns once all ranks have joined."""
        raise NotImplementedError(f"rollout backend {type(self).__name__} does not join a weight group")

    async def receive_weights(self, layouts: Sequence[Layout]) -> None:
        """Load, in place, the buckets rank 0 of the joined group broadcasts: one per layout, in order."""
        raise NotImplementedError(f"rollout backend {type(self).__name__} does not join a weight group")

    @abstractmethod
    async def sleep(self, keep_weights: bool = True) -> None:
        """Release accelerator memory between rollouts (a no-op where nothing is held);
        ``keep_weights=False``: the weights may be discarded, the next sync overwrites them all."""

    @abstractmethod
    async def wake_up(self, part: str | None = None) -> None:
        """Re-acquire what ``sleep`` released: ``part`` ``"weights"`` (before a sync loads into
        them), then ``"kv_cache"`` (before generating); None: everything."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine and free its resources; pending requests end with ``abort``."""

    async def pause(self) -> None:
        """Stop generating at the next token: requests running return what they have so far with
        finish reason ``abort`` (the agent loop continues them after ``resume``); requests that
        arrive meanwhile wait. Returns once nothing runs, so weights can change under no one."""
        raise NotImplementedError(f"rollout backend {type(self).__name__} cannot interrupt generation")

    async def resume(self) -> None:
        """Generate again after ``pause``."""
        raise NotImplementedError(f"rollout backend {type(self).__name__} cannot interrupt generation")

    def counters(self) -> dict[str, float]:
        """The engine's work since it started, as counts that only grow; the trainer logs each
        step's increase as ``rollout/engine/<name>``, so a run shows how busy and how full the
        engine was while each step trained. ``decode_rows`` over ``decode_passes`` is the mean
        running batch (logged as ``rollout/engine/batch_rows_mean``); ``forward_s`` is the
        seconds spent in forward passes. A backend that counts nothing returns none."""
        return {}


class GuardedBackend(RolloutBackend):
    """What every engine checks alike: no call after ``shutdown`` (which runs once), no empty
    prompt, an engine's error named by its request, and one warning where sleep does nothing,
    logged by the module of the backend. ``label`` names the backend in its messages."""

    label: str

    def __init__(self) -> None:
        self._closed = False
        self._calls = itertools.count()
        self._said_no_sleep = False

    def _admit(self, prompt_ids: Sequence[int], request_id: str) -> None:
        if self._closed:
            raise RuntimeError(f"{self.label} backend: request {request_id!r} after shutdown()")
        if not prompt_ids:
            raise ValueError(f"{self.label} backend: request {request_id!r} has an empty prompt")

    def _refuse_if_closed(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"{self.label} backend: {call} after shutdown()")

    def _engine_id(self, request_id: str) -> str:
        """An id no other engine call has: engines refuse a repeated one, and a request's turns share ours."""
        return f"{request_id}-{next(self._calls)}"

    @contextmanager
    def _errors_of(self, request_id: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:  # not a cancellation: that aborts the engine's request and passes as it is
            raise RuntimeError(f"{self.label} backend: request {request_id!r}: {exc}") from exc

    def _finish_reason(self, reason: Any, request_id: str) -> FinishReason:
        if reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"{self.label} backend: request {request_id!r} finished with {reason!r}")
        return reason

    def _sleeps(self, able: bool, why: str) -> bool:
        if not able and not self._said_no_sleep:
            self._said_no_sleep = True
            log = logging.getLogger(type(self).__module__)
            log.warning(f"{self.label} backend: {why}; sleep() and wake_up() do nothing")
        return able

    async def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            await self._close()

    @abstractmethod
    async def _close(self) -> None:
        """Stop the engine, once, with new calls already refused; what is in flight ends with ``abort``."""


OptionsT = TypeVar("OptionsT", bound=BaseModel)


class Backend(ABC, Generic[OptionsT]):
    """A rollout backend as a plugin declares it, in one object (as llm's models carry their
    ``Options``): ``register(MyBackend())`` in ``skip_register_backends`` makes ``name`` a choice
    of ``rollout.backend`` and declares ``Options`` as the config section ``section``. A backend
    that reads another's options (a wrapper) sets ``section = None`` and that backend's ``Options``.
    """

    name: str
    section: str | None
    Options: type[OptionsT]
    # verl's ``rollout.<key>`` this engine takes, and ``override_config`` (``model.override_config``,
    # the model's config entries replaced) -> its option's name
    verl_keys: Mapping[str, str] = {}
    joins_weight_group = False  # its RolloutBackend takes weights over a process group (``receiver``)

    def check(self, options: OptionsT) -> None:
        """Refuse in one line naming the key what would fail in a worker (no engine installed,
        no device): runs in the driver before any worker starts or the model exists."""

    def devices(self, options: OptionsT) -> int:
        """The GPUs one engine spans (its tensor-parallel size), which the run places together."""
        return 1

    @abstractmethod
    def build(self, options: OptionsT, model_dir: Path) -> RolloutBackend:
        """The engine on the model in ``model_dir``, in a rollout worker. Import the engine here:
        ``skip plugins`` and the driver's check must not pay for it."""


def find_backend(name: str, installed: Mapping[str, Backend] | None = None) -> Backend:
    """The backend named by ``rollout.backend`` (among the registered ones unless ``installed``),
    or a ConfigError naming what is installed."""
    if installed is None:
        from skip_core.plugins import registry

        installed = registry().backends
    return lookup("rollout.backend", "backend", name, installed)


def check_backend(name: str, sections: Any, installed: Mapping[str, Backend] | None = None) -> None:
    """Fail before any worker starts on an unknown backend, bad options or a missing device."""
    backend = find_backend(name, installed)
    backend.check(sections[backend.Options])


def create_backend(name: str, sections: Any, model_dir: Path) -> RolloutBackend:
    """Build the backend named by ``rollout.backend`` on ``model_dir``, with its options from
    ``sections`` (the run's validated ``skip_core.sections.Sections``)."""
    backend = find_backend(name)
    return backend.build(sections[backend.Options], model_dir)


def engine_arguments(values: Any, fields: Mapping[str, Any], package: str, module: str, name: str) -> Any:
    """An engine's options section as given, with the keys that are none of its fields but are
    arguments of the engine's own dataclass (``module.name`` of ``package``) moved under
    ``engine_arguments``: they go to the engine as given, and the rest is refused as unknown keys.
    The engine is imported only when such keys are given (seconds), and not where it is missing."""
    if not isinstance(values, Mapping) or importlib.util.find_spec(package) is None:
        return values
    others = [key for key in values if key not in fields]
    if not others:
        return values
    kind = getattr(importlib.import_module(module), name)
    # a dataclass (vLLM's) or a msgspec struct (SGLang's)
    known = set(getattr(kind, "__struct_fields__", None) or (field.name for field in dataclasses.fields(kind)))
    moved = {key: values[key] for key in others if key in known}
    kept = {key: value for key, value in values.items() if key not in moved}
    return {**kept, "engine_arguments": {**(values.get("engine_arguments") or {}), **moved}} if moved else values


def local_model_dir(path: Any) -> Path:
    """A local Hugging Face model directory; hub names are refused so nothing is downloaded."""
    if path is None or not (Path(path).expanduser() / "config.json").is_file():
        raise ConfigError(f"model.path: {path!r} is not a local Hugging Face model directory (no config.json)")
    return Path(path).expanduser()


async def one_bucket(state_dict: Mapping[str, Any]) -> AsyncIterator[Mapping[str, Any]]:
    """A whole state dict as the buckets ``update_weights`` reads."""
    yield state_dict


def untied(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """One name per tensor: a tied LM head is the embedding under a second name, which engines
    tie again themselves (and safetensors refuses)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            tensors[name] = tensor
    return tensors
