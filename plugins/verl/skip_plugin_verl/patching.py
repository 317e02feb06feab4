"""verl's classes patched in place, in every process, as their modules load.

Ray keeps an actor's methods from when it loads the class, so a patch must be in place before
then: ``install`` patches what has loaded and arms a ``sys.meta_path`` finder that patches the
rest right after each module has run (``startup.py`` arms the bridge the same way). A hook keeps
the name, signature and kind (coroutine or not) of what it replaces; a class that is not what
the patch expects is left as verl wrote it, with one warning. verl's files are never changed.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

# (module, class or None for the module itself, {function name: hook}); a hook gets verl's function first.
Group = tuple[str, "str | None", Mapping[str, Callable]]
_pending: list[Group] = []
_warn: Callable[[str], None] = print


def patch(module: Any, owner_name: str | None, hooks: Mapping[str, Callable]) -> bool:
    """Replace the named functions of ``module`` (or of its class ``owner_name``) by their hooks, all or none."""
    owner = module if owner_name is None else getattr(module, owner_name, None)
    where = module.__name__ + ("" if owner_name is None else f".{owner_name}")
    found = {name: vars(owner).get(name) for name in hooks} if owner is not None else {}
    if found and all(getattr(fn, "__skip_profiling__", False) for fn in found.values()):
        return True  # patched already (a second init)
    for name, hook in hooks.items():
        fn = found.get(name)
        # A hook keeps the kind of what it replaces: verl and Ray tell coroutine functions apart.
        if not inspect.isfunction(fn) or inspect.iscoroutinefunction(hook) != inspect.iscoroutinefunction(fn):
            _warn(f"verl's {where}.{name} is not what skip instruments; {where} is left as verl wrote it")
            return False
    for name, hook in hooks.items():
        setattr(owner, name, _bind(hook, found[name]))
    return True


def _bind(hook: Callable, original: Callable) -> Callable:
    """``hook`` with ``original`` bound first, looking like ``original`` (name, signature, kind)."""
    if inspect.iscoroutinefunction(original):

        async def wrapper(*args, **kwargs):
            return await hook(original, *args, **kwargs)
    else:

        def wrapper(*args, **kwargs):
            return hook(original, *args, **kwargs)

    functools.update_wrapper(wrapper, original)
    wrapper.__skip_profiling__ = True
    return wrapper


def initializing(module: Any) -> bool:
    """Whether ``module``'s code is still running (importlib marks its spec meanwhile)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _patch_ready(loaded: str | None = None) -> None:
    """Patch each pending class whose module has run to its end (``loaded`` just has)."""
    for group in list(_pending):
        module = sys.modules.get(group[0])
        if module is not None and (group[0] == loaded or not initializing(module)):
            _pending.remove(group)
            patch(module, group[1], group[2])
    if not _pending:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _AfterImport)]


class _AfterImport:
    """A ``sys.meta_path`` finder for the pending modules only: the spec the other finders give,
    its loader wrapped to patch once the module has run (``startup.py`` does so for the bridge)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not any(group[0] == fullname for group in _pending):
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *_: None)(fullname, path, target)
            if spec is not None:
                spec.loader = spec.loader and _Patching(spec.loader)
                return spec
        return None


class _Patching:
    """The module's own loader, then ``_patch_ready``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        if name == "_loader":  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            _patch_ready(module.__name__)
        except Exception as exc:  # profiling must leave verl importable
            _warn(f"instrumenting {module.__name__} failed ({exc!r}); it runs as verl wrote it")


def install(groups: list[Group], warn: Callable[[str], None]) -> None:
    """Patch ``groups``: what has loaded now, the rest as it loads; ``warn`` says what is left unpatched."""
    global _warn
    _warn = warn
    _pending.extend(group for group in groups if group not in _pending)
    _patch_ready()
    if _pending and not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
