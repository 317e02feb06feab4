"""The on-disk cache of step results: atomic, verified on read, confined to its directory.

Layout (verl's for role ``rollout``, so verl configs work unchanged; any other role adds a
``{role}/`` level after the run name)::

    {dump_dir}/{experiment_name}_{project_name}/GBS{gbs}_N{n}_in{prompt}_out{response}/{step}/
        meta.json              format version, role, step, namespace, input fingerprint,
                               and the size and xxh3-128 hash of every data file
        tensors.safetensors    Batch.batch
        data.json              Batch.non_tensor_batch and meta_info
    .../GBS.../generation_{k}/{step}/   the k-th extra generation of a step (DAPO), same files

A step directory is written beside its final place (``.tmp-*``, named after the process
writing it), fsynced, and renamed into place, so it is complete or absent. Readers treat every
entry as hostile (a cache may come from anyone, as a tarball that keeps pipes and links): a step
directory or file that is a link, a file that is not regular, one larger than recorded or than
its kind allows, JSON nested too deep, an entry whose tensors do not fit the step
(``skip_core.layout``) are each a warning naming the path, then a miss; never a hang, a crash
or a read without end.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import shutil
import socket
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skip_core import encoding, reading, writing
from skip_core.config import Namespace
from skip_core.entries import (
    FORMAT,
    LEFTOVER_PREFIXES,
    META,
    STEP_NAME,
    VERSION,
    CorruptEntry,
    ForeignEntry,
    path_kind,
    remove,
    seal,
    verify,
)
from skip_core.files import exclusive, fsync_dir, owned, publish, remove_abandoned, write_synced
from skip_core.layout import Expected, header
from skip_core.pending import PendingWrite, pending_writes
from skip_core.provenance import Setup


class CacheWarning(UserWarning):
    """A cache entry was ignored (corrupt, truncated, foreign) or a dump failed."""


@dataclass(frozen=True)
class Entry:
    """A verified step directory."""

    step: int
    path: Path
    meta: dict

    @property
    def fingerprint(self) -> str | None:
        return self.meta.get("fingerprint")


def safe_name(text: str) -> str:
    """One path component made from config text: no separators, no leading dots."""
    name = re.sub(r"[^A-Za-z0-9._=+-]", "_", text)[:200]
    return re.sub(r"^\.+", lambda m: "_" * len(m.group()), name) or "_"


class CacheStore:
    """The step directories of one role in one run namespace.

    A dump runs in the background after its call returned, so the next call may look up an
    entry that is still being written. ``expect(step)`` announces such a write before it
    starts; lookups of that entry then wait for it (and only for it), so this process sees
    its own dumps exactly as if they had been written synchronously, as verl writes them.

    ``setup`` is what the run generates under (``skip_core.provenance``): every entry records it.
    ``read_only``: the directory can be read but not written (a shared cache); ``SkipManager``
    then replays its entries and dumps nothing.
    """

    def __init__(self, root: str | os.PathLike, namespace: Namespace, role: str, setup: Setup | None = None) -> None:
        self.root = Path(root).expanduser().absolute()
        self.namespace = namespace
        self.role = role
        self.setup = setup
        self.read_only = False
        run = self.root / safe_name(f"{namespace.experiment_name}_{namespace.project_name}")
        # ``rollout`` keeps verl's layout; other roles nest under their name, so roles sharing
        # a dump_dir never share a step directory.
        self.directory = (run if role == "rollout" else run / safe_name(role)) / namespace.shape
        # The namespace's lock while this store (and its generations') writes it: ``hold``.
        self._lock: list[contextlib.ExitStack] = []
        self._namespace = self.directory

    def path(self, step: int) -> Path:
        return self.directory / str(int(step))

    def generation(self, index: int) -> CacheStore:
        """The store of the ``index``-th generation of each step (``SkipManager.generation_scope``):
        the first keeps verl's layout; the others nest in ``generation_<index>/`` beside the steps."""
        if index == 0:
            return self
        other = copy.copy(self)
        other.directory = self.directory / f"generation_{int(index)}"
        return other

    def check_writable(self) -> None:
        """Create the namespace directory and prove a file can be written there."""
        self._makedirs()
        with tempfile.NamedTemporaryFile(dir=self.directory, prefix=owned(".tmp-probe-")):
            pass

    def hold(self, what: str) -> None:
        """Hold the namespace's lock (``skip_core.files.exclusive``) until ``release``: another
        process's ``hold`` then stops with ``DirectoryInUse`` naming this one and ``what`` it does."""
        if not self._lock:
            self._makedirs()
            stack = contextlib.ExitStack()
            stack.enter_context(exclusive(self._namespace, what))
            self._lock.append(stack)

    def release(self) -> None:
        while self._lock:
            self._lock.pop().close()

    def remove_leftovers(self) -> list[Path]:
        """Delete what killed dumps of this namespace left (``.tmp-*``, ``.trash-*`` of processes
        that are gone; see ``skip_core.files.abandoned``), here and in the generations' directories:
        skip's own files in them only (``entries.remove``)."""
        removed = remove_abandoned(self.directory, LEFTOVER_PREFIXES, remove)
        for generation in self.directory.glob("generation_*"):
            if not generation.is_symlink():
                removed += remove_abandoned(generation, LEFTOVER_PREFIXES, remove)
        return removed

    def expect(self, step: int) -> PendingWrite:
        """Announce that this process is writing the entry of ``step``; settle the result when done."""
        return pending_writes.add((self.directory, int(step)))

    def steps(self) -> list[int]:
        """Steps that have a directory, valid or not, or a write of this process under way."""
        pending = pending_writes.steps(self.directory)
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            names = []
        except OSError as exc:
            warnings.warn(f"skip: cannot list cache directory {self.directory}: {exc}", CacheWarning, stacklevel=2)
            names = []
        return sorted(pending.union(int(n) for n in names if STEP_NAME.fullmatch(n)))

    def entry(self, step: int, expected: Expected | None = None) -> Entry | None:
        """The verified entry of ``step``, fitting ``expected`` when given; a warning naming it
        and ``None`` if it is present but bad.

        A write of this entry under way in this process is waited for; if it failed, this is a miss.
        """
        if pending_writes.wait((self.directory, int(step))) is False:
            return None
        path = self.path(step)
        if not os.path.lexists(path):
            return None
        try:
            meta = verify(path, role=self.role, namespace=self.namespace, root=self.root)
            if expected is not None and (problems := expected.problems(header(path / encoding.TENSORS))):
                raise CorruptEntry(f"it does not fit this step: {'; '.join(problems)}")
        except Exception as exc:  # CorruptEntry, or safetensors' own refusal of a header it cannot parse
            warnings.warn(f"skip.{self.role}: ignoring cache entry {path}: {exc}", CacheWarning, stacklevel=2)
            return None
        return Entry(step, path, meta)

    def nearest(self, step: int, expected: Expected | None = None) -> Entry | None:
        """The entry ``repeat`` uses: this step, else the largest below, else the smallest above."""
        present = self.steps()
        below = sorted((s for s in present if s < step), reverse=True)
        above = sorted(s for s in present if s > step)
        for candidate in [step, *below, *above]:
            found = self.entry(candidate, expected)
            if found is not None:
                return found
        return None

    def load(self, entry: Entry) -> Any:
        """The batch of a verified entry; ``CorruptEntry`` naming it if its files changed since
        they were verified or do not decode."""
        files = entry.meta["files"]
        try:
            # Each still the regular file, no larger, that was verified: data.json as it is read,
            # the tensors before safetensors maps them.
            payload = reading.read_json(entry.path / encoding.DATA, files[encoding.DATA]["bytes"], self.root)
            with reading.opened(entry.path / encoding.TENSORS, files[encoding.TENSORS]["bytes"], self.root):
                pass
            return encoding.read(entry.path, payload, files[encoding.DATA]["bytes"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptEntry(f"cannot load it: {exc}", entry.path) from None

    def save(self, step: int, batch: Any, fingerprint: str | None = None) -> Path:
        """Write ``batch`` as the entry of ``step``, replacing any previous one, atomically."""
        self._makedirs()
        tmp = Path(tempfile.mkdtemp(prefix=owned(f".tmp-{step}-"), dir=self.directory))
        try:
            names = encoding.write(batch, tmp)
            files = {name: seal(tmp / name) for name in names}
            meta = {
                "format": FORMAT,
                "version": VERSION,
                "role": self.role,
                "step": int(step),
                "namespace": dataclasses.asdict(self.namespace),
                "fingerprint": fingerprint,
                "setup": self.setup.values if self.setup is not None else None,
                "samples": len(batch),
                "files": files,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "writer": {"host": socket.gethostname(), "pid": os.getpid()},
            }
            write_synced(tmp / META, json.dumps(meta, indent=1).encode())
            fsync_dir(tmp)
            final = self.path(step)
            self._check_replaceable(final)
            publish(tmp, final, delete=remove)  # what the old entry holds of someone else's stays
            fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _check_replaceable(self, final: Path) -> None:
        """Refuse to replace what is not this skip's entry (a corrupt one of its own is replaced)."""
        kind = path_kind(final)  # one lstat: other writers may be replacing it
        if kind not in (None, "directory"):
            raise FileExistsError(f"{final} is not a directory skip wrote (a link or a file); left as it is")
        if kind == "directory":
            try:
                verify(final, deep=False, root=self.root)
            except ForeignEntry as exc:
                raise FileExistsError(f"{final}: {exc}; left as it is") from None
            except CorruptEntry:
                pass

    def _makedirs(self) -> None:
        """Create the namespace directories below the dump directory, never following a link."""
        writing.makedirs(self.root, self.directory.relative_to(self.root))
