"""``SkipManager``: verl's skip facade over pluggy hooks.

The facade keeps verl's class methods, but no per-call state lives on it: the step of an
online role is resolved per call and passed down as an argument, so concurrent asyncio tasks
and threads never see each other's step. The trainer step (``set_step``) is process-wide by
design: it is the one clock of a sequential trainer loop; ``step_scope`` binds another step to
one context, for work that runs ahead of the loop in the background.

Each role name has one ``_Slot``, created when the first function is decorated with it and
filled by ``init``. A decorated call on a disabled role, or on a trainer step that is not
listed, costs an attribute check or two before running the function.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from skip_core.caching import SetupMismatchWarning
from skip_core.config import ConfigError, Namespace, RoleConfig, StepSet, select
from skip_core.dumps import Dumps
from skip_core.errors import SkipError
from skip_core.files import DirectoryInUse
from skip_core.layout import Layout
from skip_core.plugins import pm, registry
from skip_core.provenance import Setup
from skip_core.replay import replay
from skip_core.roles import Call, Role, prompts_of, prompts_position
from skip_core.schedule import GREEDY, VALIDATE
from skip_core.sections import parse_roles
from skip_core.store import CacheStore, CacheWarning

F = TypeVar("F", bound=Callable[..., Any])

_MISS = object()
_SET_STEPS = 1 << 16


class _Clock:
    step: int | None = None


_clock = _Clock()
# A trainer step bound to one context (``SkipManager.step_scope``) wins over the clock there.
_scoped_step: contextvars.ContextVar[int | None] = contextvars.ContextVar("skip_step", default=None)


# Which generation of the trainer step a call belongs to (``SkipManager.generation_scope``):
# DAPO's dynamic sampling generates several batches in one step, each its own entry.
_generation: contextvars.ContextVar[int] = contextvars.ContextVar("skip_generation", default=0)


def _trainer_step() -> int | None:
    scoped = _scoped_step.get()
    return _clock.step if scoped is None else scoped


class _Slot:
    __slots__ = ("config", "enabled", "name", "online", "refused", "role", "steps", "store")

    def __init__(self, name: str) -> None:
        self.name = name
        self.deactivate()

    def deactivate(self) -> None:
        if getattr(self, "store", None) is not None:
            self.store.release()
        self.refused = False  # dumps refused: another live process writes this namespace
        self.enabled = False
        self.online = False
        self.steps: StepSet | frozenset[int] = frozenset()
        self.role: Role | None = None
        self.config: RoleConfig | None = None
        self.store: CacheStore | None = None

    def activate(self, role: Role, config: RoleConfig, store: CacheStore) -> None:
        self.role, self.config, self.store = role, config, store
        self.online = role.online_step
        # A set's ``in`` is C: the decorator's cost on every ineligible step. Ranges too long for one
        # (``1..``, ``1..1000000000000``) stay ranges.
        self.steps = frozenset(config.steps) if len(config.steps) <= _SET_STEPS else config.steps
        self.enabled = True

    def plan(self, fn: Callable, how: tuple[inspect.Signature, int, Layout | None], args: tuple, kwargs: dict):
        """The ``(step, call)`` of an eligible call, or ``None`` to run it untouched. ``how``: the
        function's signature, where its prompts are, and the layout it declared it returns."""
        signature, position, layout = how
        meta = getattr(prompts_of(args, kwargs, position), "meta_info", None)
        if isinstance(meta, Mapping) and (meta.get(VALIDATE) or meta.get(GREEDY)):
            return None  # validation and greedy baselines never load or dump
        call = Call(fn, args, kwargs, signature, layout)
        if self.online:
            step = pm.hook.skip_resolve_step(role=self.role, config=self.config, call=call)
        else:
            step = _trainer_step()
        if step is None or step not in self.steps:
            return None
        return step, call, self.store.generation(_generation.get())

    def would_replace(self, step: int, prompts: Any, generation: int, layout: Layout | None) -> bool:
        """Whether a call at ``step`` with ``prompts`` would be replaced: the lookup the call will
        make (entry present, verified, fitting, inputs matching), without loading. What makes a
        run stop (``on_prompt_mismatch=error`` ...) is raised now, before the run starts, and a
        replay under another setup is said now; other warnings belong to the call, when it comes."""
        if not self.enabled or (not self.online and step not in self.steps):
            return False
        store = self.store.generation(generation)
        call = Call(None, (prompts,), {}, layout=layout)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                hit = pm.hook.skip_precondition(role=self.role, config=self.config, store=store, step=step, call=call)
            except SkipError:
                raise
            except Exception:
                hit = None
        for warning in said:  # said once per run, and the calls will not say it again
            if issubclass(warning.category, SetupMismatchWarning):
                warnings.warn(warning.message, stacklevel=3)
        return hit is not None

    def replace(self, plan: tuple[int, Call, CacheStore]) -> Any:
        """The result of a replaced call, or ``_MISS`` to run the function."""
        step, call, store = plan
        result = replay(self.role, self.config, store, step, call)
        return _MISS if result is None else result

    def dump(self, plan: tuple[int, Call, CacheStore], result: Any) -> None:
        step, call, store = plan
        if store.read_only or self.refused:  # said once
            return
        try:  # the writer holds the namespace: another process's run on it would delete nothing of ours
            store.hold(f"dumping skip.{self.name}")
        except DirectoryInUse as exc:
            self.refused = True
            warnings.warn(f"skip.{self.name}: nothing is dumped: {exc}", CacheWarning, stacklevel=3)
            return
        except OSError as exc:
            warnings.warn(
                f"skip.{self.name} step {step}: dump failed, training continues: {exc!r} (writing {store.path(step)})",
                CacheWarning,
                stacklevel=3,
            )
            return
        kwargs = dict(role=self.role, config=self.config, store=store, step=step, call=call, result=result)
        # Announced before the call returns, so the next lookup of this entry waits for it.
        write = store.expect(step)
        _dumps.submit(self.name, step, store.path(step), functools.partial(pm.hook.skip_dump, **kwargs), write)


_dumps = Dumps()
_slots: dict[str, _Slot] = {}


def _slot(name: str) -> _Slot:
    return _slots.setdefault(name, _Slot(name))


class SkipManager:
    """verl-compatible entry points: ``init``, ``set_step``, ``annotate``, ``flush``, ``reset``."""

    @classmethod
    def init(cls, config: Any) -> None:
        """verl's entry point: validate ``config.skip`` and activate the enabled roles, with the
        cache namespace and setup read from verl's keys; bad config raises ``ConfigError``."""
        if config is None or not (isinstance(config, Mapping) or hasattr(config, "get")):
            raise ConfigError(
                f"SkipManager.init: expected a run config (DictConfig or dict), got {type(config).__name__}"
            )
        roles = parse_roles(select(config, "skip"), strict=False)
        cls.activate(roles, Namespace.from_config(config), Setup.from_config(config))

    @classmethod
    def activate(cls, roles: Mapping[str, RoleConfig], namespace: Namespace, setup: Setup) -> None:
        """Activate the enabled roles of ``roles`` (``skip.<role>`` already validated, by
        ``parse_roles`` or a trainer's own validation pass), caching under ``namespace``."""
        installed = registry().roles
        if missing := sorted(name for name, config in roles.items() if config.enable and name not in installed):
            raise ConfigError(f"skip.{missing[0]}: no installed plugin provides role {missing[0]!r}")
        active = {
            name: (installed[name], config, _open_store(name, config, namespace, setup))
            for name, config in roles.items()
            if config.enable
        }
        for slot in _slots.values():
            slot.deactivate()
        for name, (role, role_config, store) in active.items():
            _slot(name).activate(role, role_config, store)

    @classmethod
    def set_step(cls, step: int) -> None:
        """Set the trainer step used by roles without online steps (verl's ``global_steps``)."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"SkipManager.set_step: expected an int step, got {step!r}")
        _clock.step = step

    @classmethod
    @contextlib.contextmanager
    def step_scope(cls, step: int) -> Iterator[None]:
        """Calls in this context (and tasks or threads started from it with a copy of it) see
        trainer step ``step``, whatever ``set_step`` says meanwhile: a generation running in the
        background for step k+1 while the trainer trains step k, as overlapped schedules do."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"SkipManager.step_scope: expected an int step, got {step!r}")
        token = _scoped_step.set(step)
        try:
            yield
        finally:
            _scoped_step.reset(token)

    @classmethod
    @contextlib.contextmanager
    def generation_scope(cls, index: int) -> Iterator[None]:
        """Calls in this context are the ``index``-th generation of their trainer step (0, the
        first, is every step's): each is cached as its own entry and replayed in its place, as
        DAPO's dynamic sampling needs when it generates more batches to fill one step."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise TypeError(f"SkipManager.generation_scope: expected an int >= 0, got {index!r}")
        token = _generation.set(index)
        try:
            yield
        finally:
            _generation.reset(token)

    @classmethod
    def annotate(cls, role: str, layout: Layout | None = None, **_: Any) -> Callable[[F], F]:
        """Decorate a function, coroutine function or method as a call of ``role``.

        ``layout`` (``skip_core.layout.Layout``): the tensors the function returns, their dtypes
        and lengths; a cached result that does not fit them is not loaded but generated again.
        """
        slot = _slot(role)

        def decorate(fn: F) -> F:
            signature = inspect.signature(fn)
            how = (signature, prompts_position(signature), layout)
            if inspect.iscoroutinefunction(fn):
                return functools.wraps(fn)(_async_wrapper(slot, fn, how))
            return functools.wraps(fn)(_sync_wrapper(slot, fn, how))

        return decorate

    @classmethod
    def would_replace(
        cls, role: str, step: int, prompts: Any, generation: int = 0, layout: Layout | None = None
    ) -> bool:
        """Whether a call of ``role`` at trainer (or online) step ``step`` with ``prompts`` would
        come from the cache: a trainer can tell ahead which work it will not have to do.
        ``layout``: what the function that will be called declared it returns."""
        return _slot(role).would_replace(step, prompts, generation, layout)

    @classmethod
    def active(cls, role: str) -> tuple[Role, RoleConfig, CacheStore] | None:
        """The role, its validated section and its store when ``role`` is enabled, else ``None``:
        for a plugin whose calls do not fit one decorated function (verl's TransferQueue role)."""
        slot = _slots.get(role)
        return (slot.role, slot.config, slot.store) if slot is not None and slot.enabled else None

    @classmethod
    def hold(cls, what: str) -> None:
        """Hold the namespace of every enabled role that writes, as its dumps will (``CacheStore.hold``),
        now: a trainer stops before any work, in one line (``DirectoryInUse``), when another live
        process writes one of them. ``what``: this process's work, as that line will name it."""
        for slot in _slots.values():
            if slot.enabled and not slot.store.read_only:
                try:
                    slot.store.hold(what)
                except DirectoryInUse as exc:
                    raise DirectoryInUse(f"skip.{slot.name}.dump_dir: {exc}") from None

    @classmethod
    def release(cls) -> None:
        """Let go of the namespaces this process holds (``hold``, or its dumps'): the run is over."""
        for slot in _slots.values():
            if slot.store is not None:
                slot.store.release()

    @classmethod
    def stores(cls) -> dict[str, CacheStore]:
        """The cache store of each enabled role, by role name."""
        return {name: slot.store for name, slot in _slots.items() if slot.enabled}

    @staticmethod
    def unreachable(roles: Mapping[str, RoleConfig], last_step: int) -> dict[str, StepSet]:
        """The steps of each enabled trainer-step role of ``roles`` past ``last_step``, by role
        name: a run that ends there never reaches them (a typo such as ``1..2000`` for ``1..200``).
        An open range (``1..``, every step) is never a typo. Nothing is activated: ``--check`` asks too."""
        installed = registry().roles
        stepped = {n: c for n, c in roles.items() if c.enable and n in installed and not installed[n].online_step}
        beyond = {name: config.steps.bounded.above(last_step) for name, config in stepped.items()}
        return {name: steps for name, steps in beyond.items() if steps}

    @classmethod
    def flush(cls) -> None:
        """Return once every dump started so far is durable on disk."""
        _dumps.flush()

    @classmethod
    def reset(cls) -> None:
        """Finish pending dumps and forget config and step (for tests)."""
        _dumps.flush()
        for slot in _slots.values():
            slot.deactivate()
        _clock.step = None


def _sync_wrapper(slot: _Slot, fn: Callable, how: tuple) -> Callable:
    def wrapper(*args, **kwargs):
        if not slot.enabled or (not slot.online and _trainer_step() not in slot.steps):
            return fn(*args, **kwargs)
        plan = slot.plan(fn, how, args, kwargs)
        if plan is None:
            return fn(*args, **kwargs)
        result = slot.replace(plan)
        if result is _MISS:
            result = fn(*args, **kwargs)
            slot.dump(plan, result)
        return result

    return wrapper


def _async_wrapper(slot: _Slot, fn: Callable, how: tuple) -> Callable:
    async def wrapper(*args, **kwargs):
        if not slot.enabled or (not slot.online and _trainer_step() not in slot.steps):
            return await fn(*args, **kwargs)
        plan = slot.plan(fn, how, args, kwargs)
        if plan is None:
            return await fn(*args, **kwargs)
        result = await asyncio.to_thread(slot.replace, plan)  # verification reads files
        if result is _MISS:
            result = await fn(*args, **kwargs)
            slot.dump(plan, result)
        return result

    return wrapper


def _open_store(name: str, config: RoleConfig, namespace: Namespace, setup: Setup) -> CacheStore:
    """The role's store, its leftovers of killed dumps removed. One that exists but cannot be
    written (a shared cache) is read-only: replayed, with a warning that nothing new is dumped."""
    store = CacheStore(config.dump_path, namespace, role=name, setup=setup)
    try:
        store.check_writable()
    except OSError as exc:
        if not os.path.isdir(store.directory):
            raise ConfigError(f"skip.{name}.dump_dir: cannot write to {store.directory}: {exc}") from None
        store.read_only = True
        warnings.warn(
            f"skip.{name}.dump_dir: {store.directory} cannot be written ({exc.strerror or exc}): its entries are "
            "replayed, and nothing new is dumped",
            CacheWarning,
            stacklevel=4,
        )
        return store
    for path in store.remove_leftovers():
        warnings.warn(f"skip.{name}: removed {path}, left by a dump that was killed", CacheWarning, stacklevel=4)
    return store
