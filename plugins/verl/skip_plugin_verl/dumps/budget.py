"""What reading one verl dump may cost: a memory budget proportional to the file's size.

Every size a dump declares is charged here before anything of that size is built: numpy arrays
(shape × item size), torch storage records (the zip member's size), tensors rebuilt as views of
a storage (numel × item size, the bytes the cache entry will write for them), and the values of
``non_tensor_batch`` and ``meta_info`` as the cache entry will expand them (a value referenced
from many places is charged at each reference: verl's ``np.repeat`` of a batch shares its
prompts ``n`` times, and so can a hostile file, a million times over). Past ``FACTOR`` times the
file's size plus ``CONSTANT``, the read stops with one ``VerlDumpError`` line naming the file and
what it declared.

The stand-ins that charge are called by pickle with the pickle's arguments only, so the budget of
the file being read is found through a context variable that ``limited`` sets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from skip_core.escaping import printable

from skip_plugin_verl.dumps.errors import VerlDumpError

# Measured on dumps written by verl 0.9.1's DataProto.save_to_disk (tests/data/verl, and larger
# ones made the same way: 512 rows of 1024 + 2048 tokens, 63 MB), default and numpy serialization:
# a dump charges 2.0 to 3.8 times its size (its tensors three times: the storage record, the flat
# view over it, the leaves the entry writes; its non-tensor values once per row, though the
# rollout.n rows of a prompt share them), and 6.5 times for a contrived one (n = 64, an 8000-
# character system prompt over 64-token rows). FACTOR leaves room above that. Per byte charged,
# the import's peak resident memory grew by at most 2.1 bytes, whatever a hostile file repeated
# (plain_values), so a file of a few KB costs at most about 2.1 * CONSTANT = 35 MB more.
FACTOR = 16
CONSTANT = 16 << 20


class Budget:
    """The bytes the file ``where`` of ``size`` bytes may still declare."""

    def __init__(self, where: str, size: int) -> None:
        self.where = where
        self.size = size
        self.limit = FACTOR * size + CONSTANT
        self.used = 0

    def charge(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` for ``what`` (a phrase: "a 4x8 int64 tensor"); past the limit, refuse."""
        self.used += nbytes
        if self.used > self.limit:
            raise VerlDumpError(
                f"{printable(self.where)} declares {printable(what)} ({nbytes} bytes), bringing its read to "
                f"{self.used} bytes, past the {self.limit} allowed for a {self.size}-byte file"
            )


_current: ContextVar[Budget] = ContextVar("budget")


@contextlib.contextmanager
def limited(where: str, size: int) -> Iterator[Budget]:
    """The budget of the file ``where`` (``size`` bytes) for what is read within."""
    token = _current.set(Budget(where, size))
    try:
        yield _current.get()
    finally:
        _current.reset(token)


def current() -> Budget:
    """The budget of the file being read (``limited``)."""
    return _current.get()


def charge(nbytes: int, what: str) -> None:
    """Charge the budget of the file being read."""
    current().charge(nbytes, what)
