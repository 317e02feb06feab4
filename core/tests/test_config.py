import re

import pytest
import tomllib
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from skip_core import ConfigError, SkipManager
from skip_core.config import PLUGIN_FOLDERS, Namespace, RoleConfig, install_hint, parse_section
from skip_core.hydra_defaults import register_hydra_defaults
from skiptests import ROOT, run_config


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"action": "cahce"}, "skip.rollout.action: expected 'cache' or 'repeat', got 'cahce'"),
        ({"enable": "yes please"}, "skip.rollout.enable: expected true or false, got 'yes please'"),
        ({"steps": "1..x"}, "skip.rollout.steps: '1..x' is not a range of steps like 1..20"),
        ({"steps": "5..1"}, "skip.rollout.steps: the range '5..1' is empty: write the smaller step first"),
        ({"steps": [1, "two"]}, "skip.rollout.steps[1]: expected an integer, got 'two'"),
        ({"steps": [1, -2]}, "skip.rollout.steps[1]: expected an integer >= 0, got -2"),
        ({"steps": [1, True]}, "skip.rollout.steps[1]: expected an integer, got True"),  # not step 1
        (
            {"stpes": [1]},
            "skip.rollout.stpes: unknown key (allowed: action, dump_dir, enable, on_prompt_mismatch, "
            "on_setup_mismatch, steps); did you mean skip.rollout.steps?",
        ),
        (
            {"on_prompt_mismatch": "ignore"},
            "skip.rollout.on_prompt_mismatch: expected 'warn', 'regenerate' or 'error', got 'ignore'",
        ),
        ({"dump_dir": 5}, "skip.rollout.dump_dir: expected a string, got 5"),
    ],
)
def test_bad_values_fail_init_with_one_line_naming_the_key(tmp_path, section, message):
    with pytest.raises(ConfigError) as error:
        SkipManager.init(run_config(tmp_path, **section))
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("steps", "expected"),
    [(3, [3]), ("1..4", [1, 2, 3, 4]), (["1..3", 7], [1, 2, 3, 7]), ([2, 5], [2, 5]), ("6..6", [6])],
)
def test_steps_are_a_step_a_range_or_a_list_of_them(steps, expected):
    assert parse_section(RoleConfig, "skip.rollout", {"steps": steps}).steps == expected


def test_a_number_that_is_not_one_says_so():
    class Knob(BaseModel):
        level: float = 0.5

    with pytest.raises(ConfigError, match=r"^knob\.level: expected a number, got 'high'$"):
        parse_section(Knob, "knob", {"level": "high"})
    with pytest.raises(ConfigError, match=r"^knob\.level: expected a number, got \[1\]$"):
        parse_section(Knob, "knob", {"level": [1]})


def test_a_section_that_is_not_a_mapping_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"^skip\.rollout: expected a mapping of settings, got 'on'$"):
        SkipManager.init({"skip": {"rollout": "on"}})


def test_enabled_role_without_its_plugin_names_the_distribution(tmp_path, monkeypatch):
    config = run_config(tmp_path, role="async_rollout")
    monkeypatch.setenv("SKIP_PLUGINS", "skip-plugin-rollout")
    from skip_core import plugins

    plugins._reset_for_tests()
    try:
        hint = r"install skip-plugin-async-rollout from a clone .*: pip install \./plugins/async_rollout$"
        with pytest.raises(ConfigError, match=hint):
            SkipManager.init(config)
    finally:
        monkeypatch.delenv("SKIP_PLUGINS")
        plugins._reset_for_tests()


def test_unknown_enabled_role_lists_installed_roles(tmp_path):
    with pytest.raises(ConfigError, match=r"no installed plugin provides role 'judge' \(installed roles: .*rollout"):
        SkipManager.init(run_config(tmp_path, role="judge"))


def test_hydra_target_markers_of_verl_configs_are_ignored(tmp_path):
    config = run_config(tmp_path)
    config["skip"]["_target_"] = "verl.utils.skip.config.SkipManagerConfig"
    config["skip"]["rollout"]["_target_"] = "verl.utils.skip.config.RolloutSkipConfig"
    SkipManager.init(config)
    assert list(SkipManager.stores()) == ["rollout"]


def test_unknown_disabled_role_is_ignored(tmp_path):
    rollout = run_config(tmp_path)["skip"]["rollout"]
    SkipManager.init({"skip": {"judge": {"enable": False, "whatever": 1}, "rollout": rollout}})
    assert list(SkipManager.stores()) == ["rollout"]


def test_namespace_reads_verl_keys():
    config = {
        "trainer": {"experiment_name": "e", "project_name": "p"},
        "data": {"gen_batch_size": 96, "train_batch_size": 32, "max_prompt_length": 1024, "max_response_length": 2048},
        "actor_rollout_ref": {"rollout": {"n": 8}},
    }
    assert Namespace.from_config(config).shape == "GBS96_N8_in1024_out2048"
    del config["data"]["gen_batch_size"]
    assert Namespace.from_config(config).shape == "GBS32_N8_in1024_out2048"


def test_namespace_rejects_non_integer_lengths(tmp_path):
    config = run_config(tmp_path)
    config["data"]["max_prompt_length"] = "long"
    with pytest.raises(ConfigError, match=r"^data\.max_prompt_length: expected an integer >= 0, got 'long'$"):
        SkipManager.init(config)


def test_dump_dir_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_section(RoleConfig, "skip.rollout", {"dump_dir": "~/cache"}).dump_path == f"{tmp_path}/cache"


values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=3)), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
sections = st.dictionaries(
    st.sampled_from(["enable", "dump_dir", "steps", "action", "on_prompt_mismatch", "stepz", "Enable"]),
    values,
    max_size=5,
)


@given(sections)
@settings(max_examples=300, deadline=None)
def test_any_section_is_accepted_valid_or_rejected_naming_its_key(section):
    """Property: parsing never raises anything but ConfigError, whose message starts with the key."""
    try:
        parsed = parse_section(RoleConfig, "skip.rollout", section)
    except ConfigError as error:
        text = str(error)
        assert text.startswith("skip.rollout.")
        key = text.removeprefix("skip.rollout.").split(":")[0].split("[")[0]
        assert key in section
        assert "\n" not in text
    else:
        assert parsed.action in ("cache", "repeat")
        assert all(isinstance(s, int) and s >= 0 for s in parsed.steps)
        assert isinstance(parsed.enable, bool)


def test_hydra_overrides_work_as_in_the_design_doc(tmp_path):
    (tmp_path / "job.yaml").write_text("defaults:\n  - skip_defaults\n  - _self_\n")
    register_hydra_defaults()
    overrides = [
        "skip.rollout.enable=True",
        f"skip.rollout.dump_dir={tmp_path}/dump",
        "skip.rollout.steps=[1,2,3,10]",
        "skip.rollout.action=cache",
        "skip.async_rollout.steps=[" + ",".join(map(str, range(1, 129))) + "]",
    ]
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        config = compose(config_name="job", overrides=overrides)
    assert list(config.skip.rollout.steps) == [1, 2, 3, 10]
    assert list(config.skip.async_rollout.steps) == list(range(1, 129))
    SkipManager.init(config)
    (store,) = SkipManager.stores().values()
    assert store.directory.is_relative_to(tmp_path / "dump")

    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        bad = compose(config_name="job", overrides=["skip.rollout.enable=True", "skip.rollout.action=cahce"])
    with pytest.raises(ConfigError, match="expected 'cache' or 'repeat', got 'cahce'"):
        SkipManager.init(bad)


@pytest.mark.parametrize(("kind", "name"), sorted(PLUGIN_FOLDERS))
def test_install_hints_name_only_distributions_this_repository_has(kind, name):
    """The folder a hint names holds the distribution it names, so the line works from a clone."""
    hint = install_hint(kind, name)
    pattern = r"install (\S+) from a clone of the skip repository: pip install \./(\S+)"
    distribution, folder = re.fullmatch(pattern, hint).groups()
    project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
    assert project["name"] == distribution
    assert install_hint(kind, "not-shipped") == ""


def test_activate_refuses_an_enabled_role_nothing_installed_provides():
    """A trainer's own validation pass hands ``activate`` typed sections: a role no plugin
    provides is a line, not a KeyError."""
    from skip_core.provenance import Setup

    with pytest.raises(ConfigError, match=r"^skip\.judge: no installed plugin provides role 'judge'$"):
        SkipManager.activate({"judge": RoleConfig(enable=True)}, Namespace(), Setup({}, {}))


def test_a_role_replaying_every_step_from_0_activates(tmp_path):
    """``"0.."`` holds one step more than a length can count (``sys.maxsize``): it must still
    activate, and hold every step from 0."""
    SkipManager.init(run_config(tmp_path, role="async_rollout", steps="0.."))
    steps = parse_section(RoleConfig, "skip.async_rollout", {"steps": "0.."}).steps
    assert 0 in steps and 10**15 in steps and -1 not in steps
