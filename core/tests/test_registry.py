"""The registry in this process: computed once while the registered plugins stay the same, and a
rollout backend declared as one object (its section registered with it, its own options handed
to ``check`` and ``build``)."""

from pathlib import Path

import pytest
from pydantic import BaseModel
from skip_core import hookimpl
from skip_core.backend import Backend, check_backend, create_backend
from skip_core.config import ConfigError
from skip_core.plugins import PluginConflict, load_plugins, registry
from skip_core.sections import parse_sections

KEY = "rollout.engine_kwargs.toy"


class ToyOptions(BaseModel):
    size: int = 1


class Toy(Backend[ToyOptions]):
    """Builds no engine: ``build`` returns what it was given, for the test to read."""

    name, section, Options = "toy", KEY, ToyOptions

    def check(self, options: ToyOptions) -> None:
        if options.size > 8:
            raise ConfigError(f"{KEY}.size: at most 8, got {options.size}")

    def build(self, options: ToyOptions, model_dir: Path):
        return options, model_dir


class ToyPlugin:
    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def skip_register_backends(self, register):
        self.calls += 1
        register(Toy())


@pytest.fixture
def toy():
    pm = load_plugins()
    plugin = ToyPlugin()
    pm.register(plugin, name="toy-backend")
    yield plugin
    if pm.has_plugin("toy-backend"):
        pm.unregister(name="toy-backend")


def sections(**toy):
    return parse_sections({"rollout": {"engine_kwargs": {"toy": toy}}}, {KEY: registry().sections[KEY]})


def test_the_registry_is_computed_once_while_the_plugins_stay_the_same(toy):
    for _ in range(3):
        assert "toy" in registry().backends
    assert toy.calls == 1
    pm = load_plugins()
    pm.unregister(name="toy-backend")
    assert "toy" not in registry().backends and KEY not in registry().sections
    again = ToyPlugin()
    pm.register(again, name="toy-backend")  # a fresh object under the old name
    assert "toy" in registry().backends and again.calls == 1


def test_a_backend_declared_once_brings_its_section_and_gets_its_own_options(toy, tmp_path):
    assert registry().sections[KEY] is ToyOptions
    assert registry().provider[("sections", KEY)] == "toy-backend"
    assert create_backend("toy", sections(size=3), tmp_path) == (ToyOptions(size=3), tmp_path)
    check_backend("toy", sections(size=8))
    with pytest.raises(ConfigError, match=rf"^{KEY}\.size: at most 8, got 9$"):
        check_backend("toy", sections(size=9))


def test_the_section_of_a_backend_conflicts_as_any_other(toy):
    class Rival:
        @hookimpl
        def skip_register_sections(self, register):
            register(KEY, ToyOptions)

    pm = load_plugins()
    pm.register(Rival(), name="rival")
    try:
        with pytest.raises(PluginConflict, match=rf"^section '{KEY}' is registered by both toy-backend and rival;"):
            registry()
        lenient = registry(strict=False)
        assert lenient.provider[("sections", KEY)] == "toy-backend" and len(lenient.conflicts) == 1
    finally:
        pm.unregister(name="rival")
    assert registry().conflicts == []
