"""Roles ``reward``, ``old_log_prob``, ``ref_log_prob`` and ``values`` on the phases of verl's V1 trainer step.

verl 0.9.1's ``PPOTrainer._step_once`` runs each phase as a method that takes the step's
``KVBatchMeta``, calls a worker group and writes its result into TransferQueue under the
batch's keys: ``_compute_reward_colocate`` (``rm_scores`` and the reward's extra fields),
``_compute_old_log_prob`` (``old_log_probs``, ``entropy``, and the metric ``actor/entropy``),
``_compute_ref_log_prob`` (``ref_log_prob``), ``_compute_values`` (``values``). ``install``
wraps those methods on ``PPOTrainer`` and on every subclass that overrides one (separate_async's
``_compute_old_log_prob``), so ``skip.<role>`` in verl's config serves them with no change to
verl's code:

- a miss runs the method, then reads back every field it left for the batch's keys and the
  metrics it added, and stores them with a digest of each row's input (the tokens the phase
  consumes, read from TransferQueue);
- a hit writes the cached fields under this step's keys, each row getting the output computed
  for the row with the same input (uids are random per run, and the replay buffer and batch
  balancing order rows as they like), merges the cached metrics, and never calls a worker group.

The input fingerprint of a call is over its rows' digests, in any order: a step whose inputs
differ is handled by ``skip.<role>.on_prompt_mismatch``. With ``trainer.v1.<mode>.parameter_sync_step``
= P each phase runs P times a step; call i (verl's ``local_trigger_step``) is the i-th
generation of the step's entry.

verl's legacy ``RayPPOTrainer`` (``trainer.use_v1=false``) gets the roles ``old_log_prob``,
``ref_log_prob`` and ``values`` on its own phase methods (``LEGACY``), through skip's ``annotate``.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from skip_core import Role, SkipManager, spans
from skip_core.batch import Batch
from skip_core.entries import CorruptEntry
from skip_core.replay import load, look_up
from skip_core.roles import Call, Hit
from skip_core.store import CacheStore, CacheWarning

from skip_plugin_verl import served
from skip_plugin_verl.tensordicts import PROMPT, prompt_digests, to_batch, to_tensordict

PARTITION = "train"  # validation (partition "val") is never served from the cache
# What a log-prob or value worker reads of a trajectory that decides its output (``input_ids``
# is these tokens joined; ``response_mask`` marks tool tokens in a multi-turn response).
TOKENS = ("prompts", "responses", "response_mask")
# Kept in an entry's meta_info beside what ``tensordicts.to_batch`` keeps there.
METRICS, SIZES, RETURNS = "phase_metrics", "input_sizes", "phase_returns"
WRAPPED = "__skip_phase__"
_UNSET = object()
# The legacy trainer (``trainer.use_v1=false``): ``RayPPOTrainer``'s phase methods take the step's
# padded DataProto and return the phase's output as one, rows in the input's order (old log-probs
# with its MFU beside it), so skip's own ``annotate`` serves them, fingerprinted over the input.
# Its ``_compute_reward_colocate`` is not served: validation and REMAX's greedy baseline call it
# at the same step with nothing that tells those calls from the step's.
LEGACY = {"_compute_old_log_prob": "old_log_prob", "_compute_ref_log_prob": "ref_log_prob", "_compute_values": "values"}
MFU = "skip_legacy_mfu"


@dataclass(frozen=True)
class Phase:
    """One wrapped method: its role, the fields it reads that decide its output, and the fields
    it writes over (read back even when the batch already had them: the reward's ``rm_scores``
    over a streaming reward's, the reference worker's ``log_probs`` over the actor's)."""

    role: str
    inputs: tuple[str, ...]
    writes: tuple[str, ...]


PHASES = {
    "_compute_reward_colocate": Phase("reward", ("prompts", "responses", "raw_prompt"), ("rm_scores",)),
    "_compute_old_log_prob": Phase("old_log_prob", TOKENS, ("old_log_probs", "entropy", "log_probs")),
    "_compute_ref_log_prob": Phase("ref_log_prob", TOKENS, ("ref_log_prob", "log_probs")),
    "_compute_values": Phase("values", TOKENS, ("values",)),
}

_step_of: Callable[[], int | None] = lambda: None  # noqa: E731  (the bridge's ``SkipManager.step``)
_inside = threading.local()  # roles whose call is being served: an override's ``super()`` call passes through
_originals: dict[str, Callable] = {}  # PPOTrainer's own methods, unwrapped
_replayed: dict[str, int] = {}  # role -> the step whose first call came from the cache
_told: set[str] = set()


def install(step_of: Callable[[], int | None]) -> None:
    """Wrap the phase methods of ``PPOTrainer`` and of its subclasses that override one (each
    class's own method, once: calling this again only picks up classes defined since).
    ``step_of`` gives the trainer step; a no-op until verl's V1 trainer is imported."""
    global _step_of
    _step_of = step_of
    _replayed.clear()
    _told.clear()
    _install_legacy()
    base = sys.modules.get("verl.trainer.ppo.v1.trainer_base")
    if base is None:  # the legacy trainer, or verl not yet imported: nothing of V1 to wrap
        return
    family, todo = [], [base.PPOTrainer]
    while todo:
        cls = todo.pop()
        family.append(cls)
        todo.extend(cls.__subclasses__())
    for cls in family:
        for name, phase in PHASES.items():
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, WRAPPED, False):
                if cls is base.PPOTrainer:
                    _originals[name] = method
                setattr(cls, name, _wrap(name, method, phase))


def _install_legacy() -> None:
    module = sys.modules.get("verl.trainer.ppo.ray_trainer")
    if module is None:
        return
    cls = module.RayPPOTrainer
    for name, role in LEGACY.items():
        method = cls.__dict__.get(name)
        if callable(method) and not getattr(method, WRAPPED, False):
            setattr(cls, name, _legacy(name, method, role))


def _legacy(name: str, method: Callable, role: str) -> Callable:
    """``method`` served by ``SkipManager.annotate(role)`` for ``RayPPOTrainer`` itself; a subclass
    that overrides it (the fully-async trainer swaps weights around it, on its own step count)
    runs it untouched."""
    returns_mfu = name == "_compute_old_log_prob"

    @SkipManager.annotate(role)
    def cached(self: Any, batch: Any) -> Any:  # ``self``: where skip looks for the prompts after
        if not returns_mfu:
            return method(self, batch)
        output, mfu = method(self, batch)
        output.meta_info[MFU] = mfu
        return output

    @functools.wraps(method)
    def wrapper(trainer: Any, batch: Any) -> Any:
        if getattr(type(trainer), name) is not wrapper:
            return method(trainer, batch)
        served.reached(role)
        output = cached(trainer, batch)
        # A copy for verl, which pops fields from what it gets while the dump may still be writing it.
        meta = {k: v for k, v in output.meta_info.items() if k != MFU}
        copy = type(output)(batch=output.batch.copy(), non_tensor_batch=dict(output.non_tensor_batch), meta_info=meta)
        return (copy, output.meta_info.get(MFU)) if returns_mfu else copy

    setattr(wrapper, WRAPPED, True)
    return wrapper


def _wrap(name: str, method: Callable, phase: Phase) -> Callable:
    @functools.wraps(method)
    def wrapper(trainer: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        active, step = SkipManager.active(phase.role), _step_of()
        served.reached(phase.role)
        inside = getattr(_inside, "roles", set())
        if (
            active is None
            or phase.role in inside
            or step not in active[1].steps
            or getattr(batch, "partition_id", None) != PARTITION
            or (phase.role == "old_log_prob" and _bypass(trainer))
        ):
            return method(trainer, batch, *args, **kwargs)
        _inside.roles = inside | {phase.role}
        try:
            return _serve(name, method, phase, trainer, batch, args, kwargs, step, *active)
        finally:
            _inside.roles = inside

    setattr(wrapper, WRAPPED, True)
    return wrapper


def _bypass(trainer: Any) -> bool:
    """verl's bypass mode: old log-probs are the rollout's, copied without a worker call."""
    corr = trainer.config.algorithm.get("rollout_correction", None)
    if not (corr and corr.get("bypass_mode", False)):
        return False
    if "old_log_prob" not in _told:
        _told.add("old_log_prob")
        warnings.warn(
            "skip.old_log_prob: algorithm.rollout_correction.bypass_mode is on, so verl copies the rollout's "
            "log-probs without calling a worker; there is nothing to cache",
            CacheWarning,
            stacklevel=3,
        )
    return True


@dataclass
class _Rows:
    """The rows of one call: their TransferQueue keys, and each one's input digest and sizes."""

    keys: list[str]
    digests: list[str | None]
    sizes: list[list[int]]

    @functools.cached_property
    def call(self) -> Call:
        # Sorted: a step's input is its set of rows, whatever order the replay buffer gave them in.
        prompts = Batch(non_tensor_batch={PROMPT: np.array(sorted(self.digests, key=str), dtype=object)})
        return Call(None, (prompts,), {})


def _serve(
    name: str,
    method: Callable,
    phase: Phase,
    trainer: Any,
    batch: Any,
    args: tuple,
    kwargs: dict,
    step: int,
    role: Role,
    config: Any,
    store: CacheStore,
) -> Any:
    import transfer_queue as tq

    metrics = kwargs.get("metrics", args[0] if args else None)
    index = int(getattr(trainer, "local_trigger_step", 0) or 0)
    parts = int(getattr(trainer, "parameter_sync_step", 1) or 1)
    keys = list(batch.keys)
    inputs = tq.kv_batch_get(keys=keys, partition_id=PARTITION, select_fields=list(phase.inputs))
    rows = _Rows(keys, prompt_digests(inputs), _sizes(inputs))
    entry = _lookup(step, index, parts, role, config, store, rows.call)
    if entry is not None:
        try:
            cached = _match(entry, rows.digests, rows.sizes, leftovers=phase.role != "reward")
        except CorruptEntry as exc:
            cached, why = None, f"ignoring its cache entry: {exc}"
        else:
            why = "the cached rows do not fit this call's inputs"
        if cached is not None:
            if index == 0:
                _replayed[phase.role] = step
            return _replay(entry, cached, keys, batch, metrics)
        warnings.warn(f"skip.{role.name} step {step}: {why}; computing it instead", CacheWarning, stacklevel=3)
    if index > 0 and _replayed.get(phase.role) == step and phase.role == "old_log_prob":
        # separate_async's override restores, at a later call, the weights it saved at the
        # first call of the step; that call was replayed, so none were saved for this step.
        warnings.warn(
            f"skip.{role.name} step {step}: call {index} is not cached but the step's first call was "
            "replayed, so the weights it started from were never saved; computing under the current weights",
            CacheWarning,
            stacklevel=3,
        )
        method = _originals.get(name, method)
    before = (_field_names(keys), dict(metrics) if metrics is not None else {})
    result = method(trainer, batch, *args, **kwargs)
    if not store.read_only:
        _dump(step, phase, role, store.generation(index), rows, batch, result, metrics, before)
    return result


def _lookup(step: int, index: int, parts: int, role: Role, config: Any, store: CacheStore, call: Call) -> Batch | None:
    """The loaded entry that replaces call ``index`` of this step, or ``None`` to compute it."""
    generation = store.generation(index)

    def every_call(hit: Hit) -> bool:
        # The first call replays only with every call of the step cached: separate_async's old
        # log-probs of later calls need the weights the first call saves when it runs.
        return index > 0 or all(store.generation(i).entry(hit.step) is not None for i in range(1, parts))

    hit = look_up(role, config, generation, step, call, every_call, generation=index)
    return None if hit is None else load(role, config, generation, step, hit, call, "computing it")


def _match(entry: Batch, digests: list[str | None], sizes: list[list[int]], leftovers: bool) -> list[int] | None:
    """The cached row for each row of this call: the one computed from the same input; with
    ``leftovers`` (a mismatch loaded anyway) the others take unused rows of the same input sizes,
    in order. ``None`` if some row gets none: a score never goes to another response."""
    cached, cached_sizes = entry.non_tensor_batch.get(PROMPT), entry.meta_info.get(SIZES)
    if cached is None or not isinstance(cached_sizes, list) or len({len(cached), len(cached_sizes), len(entry)}) != 1:
        raise CorruptEntry("its rows carry no input digests and sizes")
    free: dict[Any, list[int]] = {}
    for row, digest in enumerate(cached):
        free.setdefault(digest, []).append(row)
    rows = [free[d].pop(0) if d is not None and free.get(d) else None for d in digests]
    if None not in rows:
        return rows
    if not leftovers:
        return None
    taken = set(rows)
    unused = [row for row in range(len(cached)) if row not in taken]
    for i, size in enumerate(sizes):
        if rows[i] is None:
            fits = next((row for row in unused if cached_sizes[row] == size), None)
            if fits is None:
                return None
            rows[i] = fits
            unused.remove(fits)
    return rows


def _replay(entry: Batch, rows: list[int], keys: list[str], batch: Any, metrics: dict | None) -> Any:
    """Write the cached fields under this call's keys; what the method returned when it ran:
    the batch it was given, or (old log-probs) the meta of its own ``kv_batch_put``."""
    import transfer_queue as tq

    put = tq.kv_batch_put(keys=keys, partition_id=PARTITION, fields=to_tensordict(entry, rows))
    if metrics is not None:
        metrics.update(entry.meta_info.get(METRICS) or {})
    return batch if entry.meta_info.get(RETURNS) == "input" else put


def _dump(
    step: int,
    phase: Phase,
    role: Role,
    store: CacheStore,
    rows: _Rows,
    batch: Any,
    result: Any,
    metrics: dict | None,
    before: tuple[set[str], dict],
) -> None:
    """Store what the method left: the fields new to the keys and those it writes over, and the
    metrics it added or set. A failed dump is a warning: training goes on."""
    try:
        import transfer_queue as tq

        with spans.span("skip_dump", role=role.name):
            fields_before, metrics_before = before
            after = _field_names(rows.keys)
            names = sorted((after - fields_before) | (set(phase.writes) & after))
            data = tq.kv_batch_get(keys=rows.keys, partition_id=PARTITION, select_fields=names)
            added = {k: _plain(v) for k, v in (metrics or {}).items() if metrics_before.get(k, _UNSET) is not v}
            entry = to_batch(data, rows.keys, [{} for _ in rows.keys], rows.digests)  # tags: not the phase's
            entry.meta_info.update({METRICS: added, SIZES: rows.sizes, RETURNS: "input" if result is batch else "put"})
            store.save(step, entry, fingerprint=rows.call.fingerprint)
    except Exception as exc:  # an optional feature: training goes on
        warnings.warn(
            f"skip.{role.name} step {step}: dump failed, training continues: {exc!r} (writing {store.path(step)})",
            CacheWarning,
            stacklevel=4,
        )


def _field_names(keys: list[str]) -> set[str]:
    """The fields TransferQueue holds for ``keys``: its metadata only, no data moved."""
    import transfer_queue as tq

    return set(tq.get_client().kv_retrieve_meta(keys=keys, partition_id=PARTITION, create=False).field_names)


def _sizes(data: Any) -> list[list[int]]:
    """Each row's length in every tensor field read (jagged: its own), in field-name order."""
    import torch

    rows: list[list[int]] = [[] for _ in range(data.batch_size[0])]
    for name in sorted(data.keys()):
        value = data.get(name)
        if not isinstance(value, torch.Tensor):
            continue  # a non-tensor field (``raw_prompt``): in the digest, with no length
        if value.is_nested:
            lengths = value.offsets().diff().tolist()
        else:
            lengths = [int(value.shape[1]) if value.dim() > 1 else 1] * len(rows)
        for row, length in zip(rows, lengths, strict=True):
            row.append(int(length))
    return rows


def _plain(value: Any) -> Any:
    """A metric as data: a one-element tensor as its number (numpy scalars are stored as they are)."""
    import torch

    return value.item() if isinstance(value, torch.Tensor) else value
