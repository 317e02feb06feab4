"""The user's own Python, loaded because a config key names it: verl's custom reward function
(``reward.custom_reward_function``) and custom dataset class (``data.custom_cls``).

Each file is imported once, as a module of its own, from the path as written (relative paths
from the working directory, as verl reads them). Every failure is one line naming the key: a
missing file, a file that is not Python, an import that raises, a name the module lacks.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any

from skip_core.config import ConfigError
from skip_core.escaping import printable

# An exception's message is the user's text, of any length: a message quotes this much of it.
LONGEST_EXCEPTION = 300


def source(path: str) -> Path:
    return Path(path).expanduser().absolute()


def load_object(path: str, name: str, key: str) -> Any:
    """``name`` from the Python file ``path``; ``key`` is the config section naming both."""
    file = source(path)
    if not file.exists():
        raise ConfigError(
            f"{key}.path: no such file {printable(path)!r} (relative paths are read from the working "
            f"directory, {printable(Path.cwd())})"
        )
    if file.suffix != ".py" or not file.is_file():
        raise ConfigError(f"{key}.path: expected a Python file (.py), got {printable(path)!r}")
    module_name = f"skip_user_code_{abs(hash(str(file)))}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # the user's code: its failure named in one line
            raise ConfigError(f"{key}.path: importing {printable(file)} failed: {described(exc)}") from None
        sys.modules[module_name] = module
    found = getattr(module, name, None)
    if found is None:
        raise ConfigError(f"{key}.name: {printable(file)} has no {printable(name)!r}")
    return found


def described(error: BaseException) -> str:
    """``TypeName: message`` on one line, clipped, control characters escaped."""
    text = " ".join("".join(traceback.format_exception_only(type(error), error)).split())
    if len(text) > LONGEST_EXCEPTION:
        text = text[: LONGEST_EXCEPTION - 3] + "..."
    return printable(text)
