"""Config sections that plugins declare: validated once, handed down typed, and the only keys Hydra accepts."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from pydantic import BaseModel, ConfigDict, PositiveInt
from skip_core import ConfigError, hookimpl
from skip_core.hydra_defaults import defaults, hydra_defaults, register_hydra_defaults
from skip_core.plugins import load_plugins, registry
from skip_core.sections import Sections, parse_sections


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    n: PositiveInt = 1
    name: str = "outer"


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    size: PositiveInt = 4
    required: str


DECLARED = {"outer": Outer, "outer.engines.inner": Inner}


def test_each_section_gets_only_its_own_keys_and_is_found_by_its_model():
    config = {"outer": {"n": 3, "engines": {"inner": {"size": 8, "required": "x"}}}}
    sections = parse_sections(config, DECLARED)
    assert sections[Outer] == Outer(n=3)
    assert sections[Inner] == Inner(size=8, required="x")


def test_a_missing_section_takes_its_defaults_and_a_required_key_is_named():
    with pytest.raises(ConfigError, match=r"^outer\.engines\.inner\.required: required, and not set$"):
        parse_sections({}, DECLARED)
    assert parse_sections({}, {"outer": Outer})[Outer] == Outer()


def test_a_mistyped_key_names_the_allowed_ones_and_the_closest():
    message = r"^outer\.nn: unknown key \(allowed: engines, n, name\); did you mean outer\.n\?$"
    with pytest.raises(ConfigError, match=message):
        parse_sections({"outer": {"nn": 2}}, DECLARED)


def test_between_a_section_and_one_nested_in_it_only_sections_may_stand():
    config = {"outer": {"engines": {"inne": {"required": "x"}}}}
    message = r"^outer\.engines\.inne: unknown key \(allowed: inner\); did you mean outer\.engines\.inner\?$"
    with pytest.raises(ConfigError, match=message):
        parse_sections(config, DECLARED)


def test_a_section_a_shipped_plugin_declares_is_known_even_when_that_plugin_is_not_installed():
    """``rollout.engine_kwargs.sglang`` set in a config does not trip ``rollout``'s own validation,
    and turning a section on without its plugin says what to install."""
    config = {"rollout": {"n": 2, "engine_kwargs": {"sglang": {"tp_size": 2}}}}

    class Rollout(BaseModel):
        model_config = ConfigDict(extra="forbid")
        n: int = 1

    assert parse_sections(config, {"rollout": Rollout})[Rollout].n == 2
    with pytest.raises(ConfigError, match=r"^profiling\.enable is true but no installed plugin declares profiling: .*"):
        parse_sections({"profiling": {"enable": True}}, {"rollout": Rollout})


def test_one_model_declared_for_two_keys_is_refused():
    with pytest.raises(ConfigError, match="model Outer is declared for both outer and other"):
        parse_sections({}, {"outer": Outer, "other": Outer})


def test_a_model_nobody_declared_is_a_key_error_naming_the_declared_ones():
    with pytest.raises(KeyError, match=r"no config section of model Inner is declared \(declared: Outer\)"):
        Sections(Outer())[Inner]


def test_hydra_defaults_hold_every_key_of_every_model_and_mark_the_mandatory_ones():
    assert defaults(Inner) == {"size": 4, "required": "???"}
    node = hydra_defaults({}, DECLARED)
    assert node["outer"] == {"n": 1, "name": "outer", "engines": {"inner": {"size": 4, "required": "???"}}}


class Plugin:
    @hookimpl
    def skip_register_sections(self, register):
        register("demo.engine", Inner)


@pytest.fixture
def plugin():
    pm = load_plugins()
    pm.register(Plugin(), name="demo-sections")
    yield
    pm.unregister(name="demo-sections")


def test_a_declared_section_is_in_the_registry_and_every_key_of_its_model_overrides_without_plus(plugin, tmp_path):
    assert registry().sections["demo.engine"] is Inner
    (tmp_path / "job.yaml").write_text("defaults:\n  - skip_defaults\n  - _self_\n")
    register_hydra_defaults()
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        config = compose(config_name="job", overrides=["demo.engine.size=16", "demo.engine.required=y"])
        assert parse_sections(config, {"demo.engine": Inner})[Inner] == Inner(size=16, required="y")
        with pytest.raises(ConfigCompositionException, match=r"Could not override 'demo\.engine\.sise'"):
            compose(config_name="job", overrides=["demo.engine.sise=16"])


def test_a_misspelled_registration_kind_names_the_kinds_that_exist():
    with pytest.raises(AttributeError, match=r"no registration kind 'role' \(kinds: .*backends.*roles.*sections"):
        registry().role  # noqa: B018 (the attribute access is the test)
