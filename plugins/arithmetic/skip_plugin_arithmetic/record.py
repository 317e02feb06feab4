"""Which options built each piece of a task directory, so that no run reuses a piece built with others.

``task.dir`` is where the assets live, and the run config points at them through it
(``model.path: ${task.dir}/model``), so a piece found there is used as it is. Without a record,
``task.long_share=0.15`` on a directory built with the defaults would train on the default's
problems and model without a word. Each piece therefore records the options it depends on in
``<task.dir>/task.json``; a piece recorded with other values stops the run before any work,
naming the keys that differ.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from skip_core import writing
from skip_core.config import ConfigError

RECORD = "task.json"


class BuildRecord:
    """``<directory>/task.json``: piece (a path under the directory) -> the options it was built with.

    A piece found without a record was built before the record existed: it is taken for a build
    with ``defaults`` (and recorded so) when the run asks for those, and refused otherwise.
    """

    def __init__(self, directory: Path, defaults: Mapping[str, Mapping[str, Any]]) -> None:
        self.directory, self.defaults = Path(directory), defaults
        path = self.directory / RECORD
        self.pieces: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}

    def check(self, piece: str, wanted: Mapping[str, Any]) -> None:
        """Raise, naming the keys that differ, unless ``piece`` was built with ``wanted``."""
        way_out = "delete it to rebuild it with this run's options, or set another task.dir"
        built = self.pieces.get(piece)
        if built is None:
            differ = {key: value for key, value in wanted.items() if self.defaults[piece].get(key) != value}
            if not differ:
                with contextlib.suppress(OSError):  # a directory shared read-only stays usable as it was
                    self.add(piece, wanted)
                return
            raise ConfigError(
                f"task.dir: {self.directory / piece} has no record of the options it was built with (an earlier "
                f"skip built it), and this run's are not the defaults ({_options(differ)}); {way_out}"
            )
        differ = [key for key in wanted if built.get(key) != wanted[key]]
        if differ:
            values = ", ".join(f"task.{key}={_json(built.get(key))} (this run: {_json(wanted[key])})" for key in differ)
            raise ConfigError(f"task.dir: {self.directory / piece} was built with {values}; {way_out}")

    def add(self, piece: str, options: Mapping[str, Any]) -> None:
        """Record that ``piece`` was just built with ``options``."""
        self.pieces[piece] = dict(options)
        writing.write_text(self.directory, RECORD, json.dumps(self.pieces, indent=2, sort_keys=True) + "\n")


def _json(value: Any) -> str:
    return json.dumps(value) if value is not None else "no value"


def _options(values: Mapping[str, Any]) -> str:
    return ", ".join(f"task.{key}={_json(value)}" for key, value in values.items())
