"""Run by ``skip_plugin_verl.pth`` when Python starts: arm a one-shot hook for ``verl.utils.skip``.

Right after that module has run, and so before any verl module decorates a method with its
``SkipManager``, ``bridge.install`` points the manager at skip. Until then nothing is imported
(the standard library only): a process that never imports verl pays one ``sys.meta_path``
entry, and verl's own module runs unchanged.
"""

from __future__ import annotations

import sys

TARGET = "verl.utils.skip"


# Plain classes: ``importlib.abc`` alone would add 30 ms to every interpreter's start-up.
class _Finder:
    """A ``sys.meta_path`` finder that only ever answers for ``TARGET``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        from importlib.util import find_spec

        sys.meta_path.remove(self)  # one shot, and the search below must not come back here
        spec = find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Bridging(spec.loader)
        return spec


class _Bridging:
    """verl's own loader, followed by the bridge."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str):  # get_source, is_package, resource readers: verl's
        if name == "_loader":  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        try:
            from skip_plugin_verl import bridge

            bridge.install(module)
        except Exception as exc:  # a broken bridge must leave verl working
            import warnings

            warnings.warn(f"skip-plugin-verl: the bridge failed, verl's SkipManager is its own: {exc!r}", stacklevel=2)


def arm() -> None:
    if TARGET not in sys.modules and not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


arm()
