"""skip's spans inside verl's own run, turned on by ``skip.profiling`` in verl's config.

With skip-plugin-profiling installed and ``+skip.profiling.enable=true`` (``dir``, ``steps``,
``flush_interval_s`` as for ``skip run``), each process of a verl 0.9.1 run writes what ``skip
profile report`` reads, ``{dir}/step_{k}/worker_{r}.jsonl``: the trainer (``r = -1``) its
``trainer/<phase>`` spans; each agent-loop worker (``r``: its rank) a ``rollout`` per batch and
per request ``request`` > ``preprocess``, ``turn`` > (``generate``, ``tool_call``), ``reward``.

verl's files are not changed: methods of its classes are replaced in memory, in every process
that imports verl (``install`` runs from the bridge's import hook, Ray workers included). Ray
keeps an actor's methods from when it loads the class, so the agent loop is patched as its
modules load, before any actor exists; while no sink listens a hook costs a check. Sinks are
set up per process from the config it was given: the trainer's in ``SkipManager.init``
(``start_driver``), an agent-loop worker's in its ``__init__``. Profiling never stops training:
``skip_core.spans`` switches off a sink that fails, and a verl class that is not what this module
expects is left as verl wrote it, with one warning.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from skip_core import spans

from skip_plugin_verl import patching

KEY = "skip.profiling"
DISTRIBUTION = "skip-plugin-profiling"
# verl's AgentLoopManager names its workers ``agent_loop_worker_{rank}_{uuid}``: the rank is the workid.
_ACTOR_NAME = re.compile(r"agent_loop_worker_(\d+)")
_WORKID = "_skip_profiling_workid"  # set on an agent-loop worker whose process records spans
# Trainer modules timing their phases with ``marked_timer``, and their class with ``_validate``.
_TRAINERS = {
    "verl.trainer.ppo.v1.trainer_base": "PPOTrainer",
    "verl.trainer.ppo.v1.trainer_sync": None,
    "verl.trainer.ppo.v1.trainer_colocate_async": None,
    "verl.trainer.ppo.v1.trainer_separate_async": None,
    "verl.trainer.ppo.ray_trainer": "RayPPOTrainer",
}


class VerlProfilingWarning(UserWarning):
    """Spans are off in this process, or a part of verl is left unpatched; training goes on."""


_warned: set[str] = set()
_local_ranks = itertools.count()  # a worker outside a Ray actor (driven by hand): 0, 1, ...
_configured = False  # whether this module attached the sinks this process has
_manager: Any = None  # verl's SkipManager, whose ``step`` the bridge keeps at verl's global_steps


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, VerlProfilingWarning, stacklevel=3)


# -- the key -------------------------------------------------------------------------------


def take(section: Any) -> tuple[Any, Any]:
    """``(skip section without profiling, raw skip.profiling)``: profiling is no role of skip's."""
    if not isinstance(section, Mapping) or "profiling" not in section:
        return section, None
    return {key: value for key, value in section.items() if key != "profiling"}, section["profiling"]


def parse(raw: Any) -> Any:
    """``skip.profiling`` validated by skip-plugin-profiling's model, or ``None`` when absent or off.

    A bad value raises ``ConfigError`` naming the key; with the plugin missing (or left out by
    ``SKIP_PLUGINS``) an enabled section warns once and is off.
    """
    if raw is None:
        return None
    from skip_core.config import parse_section
    from skip_core.plugins import registry

    model = registry().sections.get("profiling")
    if model is None:
        if isinstance(raw, Mapping) and str(raw.get("enable", False)).lower() in ("true", "1", "yes", "on"):
            _warn_once(
                f"{KEY}.enable is true but {DISTRIBUTION} is not installed: pip install {DISTRIBUTION} "
                "(from a clone of skip: pip install ./plugins/profiling); no spans are recorded"
            )
        return None
    settings = parse_section(model, KEY, raw)
    return settings if settings.enable else None


def _attach(settings: Any, worker: int) -> None:
    """This process's sinks, asked of the installed plugins as skip's own trainer asks them."""
    global _configured
    from skip_core.sections import Sections

    try:
        spans.configure(Sections(settings), worker)
        _configured = True
    except Exception as exc:  # a sink that cannot start must not stop the run
        spans.close()
        _warn_once(f"{KEY}: no span sink for worker {worker} ({exc!r}); no spans in this process, training goes on")


def start_driver(settings: Any, manager: type) -> None:
    """The trainer's process, from ``SkipManager.init``: sinks of worker -1, phases instrumented.

    ``settings``: what ``parse`` returned; ``manager``: verl's ``SkipManager`` (the step of a phase).
    """
    global _configured, _manager
    if settings is None:
        if _configured:  # an earlier init of this process turned spans on; this one does not
            spans.close()
            _configured = False
        return
    _attach(settings, -1)
    _manager = manager
    for name, trainer in _TRAINERS.items():
        module = sys.modules.get(name)
        if module is not None and not patching.initializing(module):
            patching.patch(module, None, {"marked_timer": _phase})
            if trainer is not None:
                patching.patch(module, trainer, {"_validate": _validate})


# -- one request ---------------------------------------------------------------------------


@dataclass
class _Request:
    """What a request's spans learn, for its ``request`` span to say at the end."""

    turns: int = 0
    tool_calls: int = 0
    response_tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    turn: Any = None  # the open ``turn`` span: opened and closed by different methods


_request: ContextVar[_Request | None] = ContextVar("skip_verl_request", default=None)


def _close_turn(state: _Request | None) -> None:
    turn = state.turn if state is not None else None
    if turn is not None:
        state.turn = None
        with contextlib.suppress(ValueError):  # closed in another context than it opened in: lost
            turn.__exit__(None, None, None)


def _int(value: Any, default: int | None = None) -> int | None:
    for candidate in (value, getattr(value, "data", None)):  # NonTensorData holds its value in .data
        with contextlib.suppress(TypeError, ValueError):
            return int(candidate)
    return default


def _step(value: Any) -> int:
    """A step as the recorder files it; verl's ``-1`` (no step given) goes to step 0."""
    return max(_int(value, 0), 0)


def _workid(worker: Any) -> int:
    return getattr(worker, _WORKID, 0)


# -- what runs in place of verl's methods: each gets verl's function first -------------------


def _init_worker(original: Callable, self, config, *args, **kwargs) -> None:
    original(self, config, *args, **kwargs)
    try:
        from skip_core.config import select

        settings = parse(select(config, KEY))
    except Exception as exc:  # validated once, in the trainer; here it can only warn
        _warn_once(f"{KEY}: {exc}; no spans in this agent-loop worker")
        return
    if settings is not None:
        name = None
        with contextlib.suppress(Exception):
            import ray

            name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
        match = _ACTOR_NAME.match(name or "")
        setattr(self, _WORKID, int(match.group(1)) if match else next(_local_ranks))
        _attach(settings, _workid(self))


async def _rollout(original: Callable, self, batch, *args, **kwargs) -> Any:
    if not spans.enabled():
        return await original(self, batch, *args, **kwargs)
    meta = getattr(batch, "meta_info", None) or {}
    validate = bool(meta.get("validate", False))
    phase, step, rank = "val" if validate else "train", _step(meta.get("global_steps")), _workid(self)
    with spans.span("rollout", step=step, phase=phase, workid=rank, requests=len(batch), validate=validate):
        output = await original(self, batch, *args, **kwargs)
    spans.flush()  # the batch's spans are on disk by the time the trainer has the batch
    return output


async def _request_span(original: Callable, self, sampling_params, trajectory, **kwargs) -> Any:
    if not spans.enabled():
        return await original(self, sampling_params, trajectory, **kwargs)
    # The V1 (TransferQueue) worker starts requests with no batch span: each carries its own context.
    attrs = {
        "step": _step(trajectory.get("step")),
        "phase": "val" if bool(trajectory.get("validate")) else "train",
        "workid": _workid(self),
        "request_id": uuid4().hex,  # verl draws its own inside the agent loop, after this span opens
        "offset": _int(kwargs.get("session_id", trajectory.get("rollout_n")), 0),
        "prompt": _int(trajectory.get("sample_index")),
        "agent": kwargs.get("agent_name"),
        **({"uid": str(kwargs["uid"])} if kwargs.get("uid") is not None else {}),
    }
    state = _Request()
    token = _request.set(state)
    try:
        with spans.span("request", **attrs) as span:
            try:
                return await original(self, sampling_params, trajectory, **kwargs)
            finally:
                _close_turn(state)
                span.set(**{key: value for key, value in vars(state).items() if key != "turn"})
    finally:
        _request.reset(token)


async def _preprocess(original: Callable, self, *args, **kwargs) -> Any:
    if not spans.enabled():
        return await original(self, *args, **kwargs)
    with spans.span("preprocess") as span:
        ids = await original(self, *args, **kwargs)
        span.set(prompt_tokens=len(ids))
    state = _request.get()
    if state is not None and state.prompt_tokens is None:
        state.prompt_tokens = len(ids)
    return ids


async def _generate(original: Callable, self, *args, **kwargs) -> Any:
    if not spans.enabled():
        return await original(self, *args, **kwargs)
    state, prompt = _request.get(), kwargs.get("prompt_ids") or ()
    with _own_turn(state), spans.span("generate", tokens_in=len(prompt)) as span:
        output = await original(self, *args, **kwargs)
        tokens, reason = len(getattr(output, "token_ids", None) or ()), getattr(output, "stop_reason", None)
        span.set(tokens_out=tokens, **({"finish_reason": reason} if reason else {}))
    if state is not None:
        state.response_tokens += tokens
        state.finish_reason = reason or state.finish_reason
        state.prompt_tokens = len(prompt) if state.prompt_tokens is None else state.prompt_tokens
    return output


async def _attempts(original: Callable, self, *args, **kwargs) -> Any:
    # FullyAsyncLLMServerClient calls the engine again after a weight sync aborted a generation:
    # the attempts, each a ``generate``, are one turn.
    if not spans.enabled():
        return await original(self, *args, **kwargs)
    with _own_turn(_request.get()):
        return await original(self, *args, **kwargs)


@contextlib.contextmanager
def _own_turn(state: _Request | None) -> Iterator[None]:
    """The turn of an agent loop that has none of its own (single turn, a user's loop)."""
    if state is None or state.turn is not None:
        yield
        return
    state.turns += 1
    with spans.span("turn", turn=state.turns) as state.turn:
        try:
            yield
        finally:
            state.turn = None


async def _turn_start(original: Callable, self, *args, **kwargs) -> Any:
    state = _request.get()
    if state is None:
        return await original(self, *args, **kwargs)
    # ToolAgentLoop's turn: this generation and the tool calls it asks for, which run in the
    # next state; the span stays open across the two methods, in the request's context.
    _close_turn(state)
    state.turns += 1
    state.turn = spans.span("turn", turn=state.turns)
    state.turn.__enter__()
    try:
        following = await original(self, *args, **kwargs)
    except BaseException:
        _close_turn(state)
        raise
    if getattr(following, "name", None) != "PROCESSING_TOOLS":
        _close_turn(state)
    return following


async def _turn_end(original: Callable, self, *args, **kwargs) -> Any:
    try:
        return await original(self, *args, **kwargs)
    finally:
        _close_turn(_request.get())


async def _tool_call(original: Callable, self, tool_call, *args, **kwargs) -> Any:
    state = _request.get()
    if state is None:
        return await original(self, tool_call, *args, **kwargs)
    with spans.span("tool_call", tool=str(getattr(tool_call, "name", "?"))):
        result = await original(self, tool_call, *args, **kwargs)
    state.tool_calls += 1
    return result


async def _reward(original: Callable, self, outputs, *args, **kwargs) -> Any:
    if not spans.enabled() or getattr(self, "reward_loop_worker_handles", None) is None:
        return await original(self, outputs, *args, **kwargs)  # no streaming reward: nothing to time
    _close_turn(_request.get())
    with spans.span("reward") as span:
        result = await original(self, outputs, *args, **kwargs)
        score = getattr(outputs[-1], "reward_score", None) if outputs else None
        span.set(**({"score": float(score)} if score is not None else {}))
    return result


def _padding(original: Callable, self, inputs, *args, **kwargs) -> Any:
    with spans.span("padding", requests=len(inputs)):
        return original(self, inputs, *args, **kwargs)


@contextlib.contextmanager
def _phase(original: Callable, name, timing_raw, *args, **kwargs) -> Iterator[None]:
    step = _step(getattr(_manager, "step", 0))
    with spans.span(f"trainer/{name}", step=step), original(name, timing_raw, *args, **kwargs):
        yield


def _validate(original: Callable, self, *args, **kwargs) -> Any:
    with spans.span("trainer/validate", step=_step(getattr(self, "global_steps", 0)), phase="val"):
        return original(self, *args, **kwargs)


# -- patching verl in place ----------------------------------------------------------------

_AGENT_LOOP_MODULE = "verl.experimental.agent_loop.agent_loop"
# (module, class, {method: hook}): the agent loop's side, patched in every process as it loads.
_GROUPS = [
    ("verl.workers.rollout.llm_server", "LLMServerClient", {"generate": _generate}),
    ("verl.workers.rollout.llm_server", "FullyAsyncLLMServerClient", {"generate": _attempts}),
    (_AGENT_LOOP_MODULE, "AgentLoopBase", {"ct_build_initial_tokens": _preprocess}),
    (
        _AGENT_LOOP_MODULE,
        "AgentLoopWorker",
        {"__init__": _init_worker, "generate_sequences": _rollout, "_run_agent_loop": _request_span},
    ),
    (_AGENT_LOOP_MODULE, "AgentLoopWorker", {"_compute_score": _reward, "_postprocess": _padding}),
    (
        "verl.experimental.agent_loop.tool_agent_loop",
        "ToolAgentLoop",
        {"_handle_generating_state": _turn_start, "_handle_processing_tools_state": _turn_end},
    ),
    ("verl.experimental.agent_loop.tool_agent_loop", "ToolAgentLoop", {"_call_tool": _tool_call}),
]


def install() -> None:
    """Instrument verl's agent loop: what has loaded now, the rest as it loads (``bridge.install``)."""
    patching.install(_GROUPS, lambda message: _warn_once(f"{DISTRIBUTION}: {message}; its spans are missing"))
