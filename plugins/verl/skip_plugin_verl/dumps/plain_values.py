"""What a dump's pickle built, rebuilt from plain values only, each charged as the entry expands it.

``plain`` walks a value the restricted unpickler returned (``non_tensor_batch``, ``meta_info``,
a ``NonTensorData``'s data) and returns a copy made only of None, bool, int, float, str, bytes,
numpy scalars and arrays of the dtypes ``numpy_pickle`` builds, and lists, tuples and dicts of
those: numpy's stand-ins become real arrays and scalars here, an object array is rebuilt value
by value from the list numpy pickled, and anything else (a torch object, a stand-in's instance,
a set, a bytearray) is refused, naming where it sits. It also refuses a value that contains
itself and nesting deeper than ``MAX_DEPTH``.

Every value is charged to the file's budget at each place it is referenced, as the cache
entry's JSON will write it out: pickle's memo lets a 300-byte file reference one list from
two places at each of 25 levels, 2**25 copies once expanded (that file wrote a 2.4 GB entry and
took 10 GB). A shared value is walked once and its cost charged again at each further
reference, so the walk itself stays linear in the file and stops at the first charge past the
budget.
"""

from __future__ import annotations

from json.encoder import encode_basestring_ascii
from typing import Any

import numpy as np
from skip_core.escaping import printable
from skip_core.reading import MAX_DEPTH

from skip_plugin_verl.dumps import budget
from skip_plugin_verl.dumps.errors import VerlDumpError
from skip_plugin_verl.dumps.numpy_pickle import PickledArray, PickledScalar
from skip_plugin_verl.dumps.restricted_pickle import describe
from skip_plugin_verl.dumps.torch_archive import PickledTensor

# What a value costs the store, which turns it into JSON-ready objects and then text, per
# reference: a slot in a container and a number's text; a list's or dict's header; and the tagged
# object the store writes for bytes, tuples and numpy values (a dict and its keys: about 340
# bytes of objects measured per reference). A string costs its JSON text, escapes included (an
# emoji is 12 bytes there). Measured through ``import_verl``, the peak resident memory then stays
# within 2.1 bytes per byte charged, whatever kind of value a file repeats.
_REFERENCE = 16
_CONTAINER = 64
_TAGGED = 256
_ATOMS = (type(None), bool, int, float)


class _Refused(Exception):
    """A value ``plain`` cannot keep: the reason, and the path to it, filled in on the way out."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.path: list[str] = []


def plain(value: Any, where: str) -> Any:
    """``value`` rebuilt from plain values only (see the module); ``where`` names it in errors."""
    try:
        return _Walk(where).value(value, 0)
    except _Refused as refused:
        path = refused.path[::-1]
        if len(path) > 8:  # a file can nest 100 levels: the start and the end say where
            path = [*path[:4], f"...{len(path) - 7} levels...", *path[-3:]]
        raise VerlDumpError(f"{printable(where)}{''.join(path)}: {refused}") from None


class _Walk:
    def __init__(self, where: str) -> None:
        self.what = f"{where}, its shared values counted each time, as a cache entry writes them"
        self.budget = budget.current()
        self.done: dict[int, tuple[Any, int]] = {}  # id of a container walked -> its copy, its cost
        self.open: set[int] = set()  # ids of the containers being walked: reaching one again is a cycle

    def value(self, value: Any, depth: int) -> Any:
        kind = type(value)
        if kind in _ATOMS:
            self.budget.charge(_REFERENCE + (value.bit_length() // 8 if kind is int else 0), self.what)
            return value
        if kind is str:
            self.budget.charge(_REFERENCE + _json_size(value), self.what)
            return value
        if kind is bytes:
            self.budget.charge(_TAGGED + 2 * len(value), self.what)  # base64
            return value
        if kind is PickledScalar:
            self.budget.charge(_TAGGED + value.value.itemsize, self.what)
            return value.value
        if kind not in (list, tuple, dict, PickledArray):
            raise _Refused(f"holds {_foreign(value)}, which a skip entry cannot store as data")
        key = id(value)
        if key in self.done:
            copy, cost = self.done[key]
            self.budget.charge(cost, self.what)
            return copy
        if key in self.open:
            raise _Refused("contains itself")
        if depth >= MAX_DEPTH:
            raise _Refused(f"is nested more than {MAX_DEPTH} levels deep")
        self.open.add(key)
        before = self.budget.used
        self.budget.charge(_CONTAINER if kind in (list, dict) else _TAGGED, self.what)
        copy = self._container(value, depth + 1)
        self.open.discard(key)
        self.done[key] = copy, self.budget.used - before
        return copy

    def _container(self, value: Any, depth: int) -> Any:
        if type(value) is dict:
            return {self._key(k, depth): self._item(v, k, depth) for k, v in value.items()}
        if type(value) is PickledArray:
            return self._array(value, depth)
        items = [self._item(v, i, depth) for i, v in enumerate(value)]
        return items if type(value) is list else tuple(items)

    def _item(self, value: Any, index: Any, depth: int, prefix: str = "") -> Any:
        """``value``, found at ``index`` of its container (named in an error only: ``describe`` costs)."""
        try:
            return self.value(value, depth)
        except _Refused as refused:
            refused.path.append(f"[{prefix}{describe(index)}]")
            raise

    def _key(self, key: Any, depth: int) -> Any:
        copy = self._item(key, key, depth, prefix="key ")
        try:
            hash(copy)
        except TypeError:
            raise _Refused(f"has a key {describe(key)} that is not hashable") from None
        return copy

    def _array(self, array: PickledArray, depth: int) -> np.ndarray:
        if array.shape is None:
            raise _Refused("holds a numpy array without its state")
        if array.array is not None:  # numeric: its bytes were checked and charged when it was built
            self.budget.charge(array.array.size * (_REFERENCE + array.array.itemsize), self.what)
            return array.array
        out = np.empty(array.shape, dtype=object)
        flat = out.reshape(-1)  # a view: numpy pickles an object array's values in C order
        for i, item in enumerate(array.values):
            flat[i] = self._item(item, i, depth)
        return out


def _json_size(text: str) -> int:
    """The length of ``text`` in the entry's JSON: ASCII as it is, else escaped (``\\u00e9``)."""
    return len(text) if text.isascii() and text.isprintable() else len(encode_basestring_ascii(text))


def _foreign(value: Any) -> str:
    """What to call a value that is not plain, in an error."""
    if isinstance(value, PickledTensor):
        return "a torch tensor"
    if isinstance(value, type) or callable(value):
        return f"the global {describe(value)}"
    return f"a {printable(type(value).__name__)}"
