"""Role ``rollout_tq``: the rollouts of verl's V1 trainer, cached and replayed through TransferQueue.

verl 0.9.1 decorates two methods with ``SkipManager.annotate_tq(role, phase)``; served by skip:

- ``submit`` (the trainer's ``_add_batch_to_generate``): the next prompt batch is always drawn,
  so the dataloader stays where it would be. On a hit the step's cached trajectories go into
  TransferQueue under the prompts' new uids, tagged as of this step, and the prompts are marked
  finished, so the replay buffer samples them at once and the agent loop is never called.
- ``sample`` (``ReplayBuffer.sample``): after the real call, the sampled trajectories of the
  train partition are read back and stored. With ``trainer.v1.<mode>.parameter_sync_step`` = P
  the trainer samples P times a step: call i is the i-th generation of the step's entry (skip's
  ``generation_<i>/``), and a hit needs all P, merged on load.

Unlike verl's own code, an entry is data only (``tensordicts``), written atomically and verified
on read, and it records what was asked: a digest of every prompt behind the uids. A step whose
prompts differ from the entry's is a mismatch handled by ``skip.rollout_tq.on_prompt_mismatch``;
on a replay each prompt gets the trajectories generated for it, and only trajectories whose
prompt is not in this step (an overlapped schedule trains on earlier steps' prompts too) are
mapped onto the remaining uids in order, as verl maps them all.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from skip_core import Role, SkipManager, spans
from skip_core.batch import Batch
from skip_core.entries import CorruptEntry
from skip_core.replay import load, look_up
from skip_core.roles import Call, Hit
from skip_core.store import CacheStore, CacheWarning

from skip_plugin_verl import served
from skip_plugin_verl.tensordicts import KEY, PROMPT, TAGS, prompt_digests, to_batch, to_tensordict

PHASES = ("submit", "sample")
PARTITION = "train"
# Steps of bookkeeping kept for an overlapped schedule, whose samples trail its submits.
WINDOW = 64


class _Run:
    """What the submit phase learnt, for the sample phase of the same or a later step."""

    def __init__(self, parts: int = 1) -> None:
        self.parts = parts
        self.prompts: dict[str, tuple[int, str | None]] = {}  # uid -> (step, prompt digest)
        self.fingerprints: dict[int, str | None] = {}
        self.replayed: dict[int, list] = {}  # step -> what to put before each of its sample calls
        self.sampled: dict[int, int] = {}

    def submitted(self, step: int, uids: list[str], digests: list[str | None], fingerprint: str | None) -> None:
        old = step - WINDOW
        self.prompts = {uid: seen for uid, seen in self.prompts.items() if seen[0] > old}
        for book in (self.fingerprints, self.sampled, self.replayed):
            for gone in [s for s in book if s <= old]:
                del book[gone]
        self.prompts.update((uid, (step, digest)) for uid, digest in zip(uids, digests, strict=True))
        self.fingerprints[step] = fingerprint


_run = _Run()


def reset(config: Any) -> None:
    """Forget the previous run's bookkeeping (``SkipManager.init``); P from verl's config, as verl reads it."""
    from skip_core.config import select

    global _run
    mode = select(config, "trainer.v1.trainer_mode") or "sync"
    parts = select(config, f"trainer.v1.{mode}.parameter_sync_step") or 1
    _run = _Run(int(parts))


def annotate_tq(role: str, phase: str, step_of: Callable[[], int]) -> Callable:
    """verl's ``SkipManager.annotate_tq`` for a skip role; ``step_of`` gives the trainer step."""
    if phase not in PHASES:
        raise ValueError(f"annotate_tq: phase must be one of {', '.join(PHASES)}, got {phase!r}")

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(owner, *args, **kwargs):
            active, step = SkipManager.active(role), step_of()
            if active is not None:
                served.reached(role)
            if active is None or step not in active[1].steps:
                return fn(owner, *args, **kwargs)
            if phase == "submit":
                return _submit(owner, step, *active)
            if kwargs.get("partition_id", args[1] if len(args) > 1 else None) != PARTITION:
                return fn(owner, *args, **kwargs)  # validation
            index = _run.sampled.get(step, 0)
            _run.sampled[step] = index + 1
            replayed = _run.replayed.get(step)
            if replayed is not None and 0 < index < len(replayed):
                _put(replayed[index])  # the part of a replayed step this call sampled when it was dumped
            result = fn(owner, *args, **kwargs)
            if replayed is None:
                _sample(result, step, index, *active)
            return result

        return wrapper

    return decorate


def _submit(trainer: Any, step: int, role: Role, config: Any, store: CacheStore) -> None:
    batch = trainer._next_train_batch()  # always drawn: the dataloader stays aligned on a hit
    uids = [str(uid) for uid in batch["uid"]]
    digests = prompt_digests(batch)
    prompts = Batch(non_tensor_batch={PROMPT: np.array(digests, dtype=object)})
    call = Call(None, (prompts,), {})
    _run.submitted(step, uids, digests, call.fingerprint)
    parts = _lookup(step, role, config, store, call)
    if parts is None:
        trainer._submit_batch_to_rollout(batch)
        return
    calls = _injections(step, parts, uids, digests)
    _put(calls[0])
    _run.replayed[step] = calls


def _lookup(step: int, role: Role, config: Any, store: CacheStore, call: Call) -> list[Batch] | None:
    """The P loaded parts of the entry that replaces this step, or ``None`` to generate."""
    entries: list[Any] = []

    def every_part(hit: Hit) -> bool:
        """An entry is all its parts, from one run."""
        entries[:] = [hit.source, *(store.generation(i).entry(hit.step) for i in range(1, _run.parts))]
        return all(entry is not None and entry.fingerprint == hit.source.fingerprint for entry in entries)

    hit = look_up(role, config, store, step, call, every_part)
    if hit is None:
        return None
    parts = [
        load(role, config, store.generation(i), step, Hit(hit.step, entry), call, "generating it")
        for i, entry in enumerate(entries)
    ]
    return None if any(part is None for part in parts) else parts


def _injections(step: int, parts: list[Batch], uids: list[str], digests: list[str | None]) -> list[list[tuple]]:
    """What goes into TransferQueue before each ``sample`` call of the step, as
    ``kv_batch_put`` arguments: each prompt with the trajectories of the part its cached group
    was sampled in, so every call samples what it sampled when the entry was dumped. All of it
    built before the first write: a bad entry must not leave half a step behind."""
    from tensordict import NonTensorStack

    groups = _groups(parts)
    owners = _assign(groups, uids, digests)
    calls: list[list[tuple]] = [[] for _ in parts]
    for index in range(len(parts)):
        prompts = [uid for uid in uids if groups[owners[uid]][1][0][0] == index]
        if not prompts:
            continue
        for source, part in enumerate(parts):
            rows, keys, tags, owner_of_row = [], [], [], []
            for uid in prompts:
                for part_index, row, suffix in groups[owners[uid]][1]:
                    if part_index == source:
                        tag = {**part.non_tensor_batch[TAGS][row], "global_steps": step}
                        tag.update(min_global_steps=step, max_global_steps=step)
                        tag.pop("is_prompt", None)
                        rows.append(row), keys.append(uid + suffix), tags.append(tag), owner_of_row.append(uid)
            if rows:
                fields = to_tensordict(part, rows)
                if "uid" in fields:  # the group id the advantage is computed over
                    fields["uid"] = NonTensorStack(*owner_of_row)
                calls[index].append({"keys": keys, "fields": fields, "tags": tags})
        finished = [{"is_prompt": True, "status": "finished", "global_steps": step} for _ in prompts]
        calls[index].append({"keys": prompts, "tags": finished})
    return calls


def _put(writes: list[dict]) -> None:
    import transfer_queue as tq

    for write in writes:
        tq.kv_batch_put(partition_id=PARTITION, **write)


def _groups(parts: list[Batch]) -> dict[str, tuple[str | None, list[tuple[int, int, str]]]]:
    """Trajectories by the uid of their prompt, in order of first appearance: (prompt digest,
    [(part, row, key suffix ``_{session}_{index}``)]). ``CorruptEntry`` for columns no dump wrote."""
    groups: dict[str, tuple[str | None, list]] = {}
    for index, part in enumerate(parts):
        keys, tags, prompts = (part.non_tensor_batch.get(name) for name in (KEY, TAGS, PROMPT))
        if keys is None or tags is None or prompts is None or keys.ndim != 1:
            raise CorruptEntry("its trajectories carry no TransferQueue keys and tags")
        for row, (key, tag, digest) in enumerate(zip(keys, tags, prompts, strict=True)):
            parts_of_key = key.rsplit("_", 2) if isinstance(key, str) else []
            if len(parts_of_key) != 3 or not all(parts_of_key) or not isinstance(tag, dict):
                raise CorruptEntry(f"trajectory {row} has key {key!r} and tags {type(tag).__name__}")
            if digest is not None and not isinstance(digest, str):
                raise CorruptEntry(f"trajectory {row} has a prompt digest of type {type(digest).__name__}")
            groups.setdefault(parts_of_key[0], (digest, []))[1].append((index, row, key[len(parts_of_key[0]) :]))
    if not groups:
        raise CorruptEntry("it holds no trajectories")
    return groups


def _assign(groups: dict, uids: list[str], digests: list[str | None]) -> dict[str, str]:
    """Which cached group each new uid gets: the one generated for the same prompt, else the
    groups left over in order, cycling when there are fewer (verl's mapping)."""
    by_prompt: dict[str, list[str]] = {}
    for old, (digest, _) in groups.items():
        if digest is not None:
            by_prompt.setdefault(digest, []).append(old)
    owners = {}
    for uid, digest in zip(uids, digests, strict=True):
        if by_prompt.get(digest):
            owners[uid] = by_prompt[digest].pop(0)
    taken = set(owners.values())
    left = [old for old in groups if old not in taken] or list(groups)
    for i, uid in enumerate(uid for uid in uids if uid not in owners):
        owners[uid] = left[i % len(left)]
    return owners


def _sample(result: Any, step: int, index: int, role: Role, config: Any, store: CacheStore) -> None:
    """Store what the ``index``-th sample call of a generated step got from the replay buffer."""
    meta = result[0] if isinstance(result, tuple) else result
    if store.read_only or index >= _run.parts:
        return
    try:
        import transfer_queue as tq

        with spans.span("skip_dump", role=role.name):
            data = tq.kv_batch_get(keys=list(meta.keys), partition_id=PARTITION)
            uids = [key.rsplit("_", 2)[0] for key in meta.keys]
            prompts = [_run.prompts.get(uid, (step, None))[1] for uid in uids]
            batch = to_batch(data, meta.keys, meta.tags, prompts)
            store.generation(index).save(step, batch, fingerprint=_run.fingerprints.get(step))
    except Exception as exc:  # an optional feature: training goes on
        warnings.warn(
            f"skip.{role.name} step {step}: dump failed, training continues: {exc!r} (writing "
            f"{store.generation(index).path(step)})",
            CacheWarning,
            stacklevel=4,
        )
