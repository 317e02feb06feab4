"""Plugin discovery through installed entry points, in fresh interpreters."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPORT = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from skip_core.plugins import installed
    rows = [(dist, sorted(provided.get("roles", []))) for _, dist, _, provided in installed()]
    provides = {}
    for _, dist, _, p in installed():
        for kind, names in p.items():
            provides.setdefault(dist, {}).setdefault(kind, []).extend(sorted(names))
print(json.dumps({"rows": rows, "provides": provides, "warnings": [str(w.message) for w in caught]}))
"""


def loaded(site: Path | None = None, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "SKIP_PLUGINS"} | env
    if site is not None:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", REPORT], env=environ, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def distributions(**env: str) -> list[str]:
    """Loaded distributions in load order, each once (core has several default plugins)."""
    return list(dict.fromkeys(dist for dist, _ in loaded(**env)["rows"]))


def install_distribution(site: Path, name: str, module: str, source: str) -> None:
    """Lay out an installed distribution (what pip writes): its module and a dist-info."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{name.replace('-', '_')}-0.3.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.3.0\n")
    (info / "entry_points.txt").write_text(f"[skip]\n{module} = {module}\n")


def test_installed_plugins_are_discovered_with_their_roles():
    rows = dict(map(tuple, loaded()["rows"]))
    assert rows["skip-plugin-rollout"] == ["rollout"]
    assert rows["skip-plugin-async-rollout"] == ["async_rollout"]
    assert rows["skip-core"] == []


def test_the_trainer_arithmetic_and_hf_provide_the_embedded_default():
    """The trainer's own hooks (tools, tool parsers, tasks, rewards) are registration kinds like core's."""
    provides = loaded()["provides"]
    trainer, arithmetic = provides["skip-plugin-trainer"], provides["skip-plugin-arithmetic"]
    assert (trainer["schedules"], trainer["tool_parsers"], trainer["rewards"]) == (["sync"], ["hermes"], ["task"])
    assert (arithmetic["tools"], arithmetic["tasks"]) == (["calculator"], ["arithmetic"])
    assert provides["skip-plugin-hf"] == {"backends": ["hf"], "sections": ["rollout.hf"]}
    assert "skip-core" not in provides  # core provides hooks' defaults, not named things


def test_skip_plugins_restricts_loading_to_the_named_distributions():
    assert distributions(SKIP_PLUGINS="skip-plugin-rollout") == ["skip-core", "skip-plugin-rollout"]
    assert distributions(SKIP_PLUGINS="skip_plugin_async_rollout") == ["skip-core", "skip-plugin-async-rollout"]


def test_empty_skip_plugins_loads_none():
    assert distributions(SKIP_PLUGINS="") == ["skip-core"]


def test_a_plugin_that_fails_to_import_warns_and_the_rest_load(tmp_path):
    install_distribution(tmp_path, "skip-plugin-broken", "skip_plugin_broken", "import not_a_module_anywhere\n")
    result = loaded(site=tmp_path)
    (warning,) = [w for w in result["warnings"] if "broken" in w]
    assert "'skip-plugin-broken' failed to load" in warning and "not_a_module_anywhere" in warning
    assert "skip-plugin-rollout" in [d for d, _ in result["rows"]]


def test_a_separately_installed_distribution_provides_a_role(tmp_path):
    install_distribution(
        tmp_path,
        "skip-plugin-scores",
        "skip_plugin_scores",
        """
        from skip_core import Role, hookimpl

        @hookimpl
        def skip_register_roles(register):
            register(Role(name="scores"))
        """,
    )
    assert ["skip-plugin-scores", ["scores"]] in loaded(site=tmp_path)["rows"]


def test_a_backend_is_one_declaration_that_registers_its_section_and_schedules_register_by_name(tmp_path):
    install_distribution(
        tmp_path,
        "skip-plugin-engines",
        "skip_plugin_engines",
        """
        from pydantic import BaseModel
        from skip_core import hookimpl
        from skip_core.backend import Backend

        class ToyOptions(BaseModel):
            size: int = 1

        class Toy(Backend):
            name, section, Options = "toy", "rollout.engine_kwargs.toy", ToyOptions

            def build(self, options, model_dir):
                raise NotImplementedError

        @hookimpl
        def skip_register_backends(register):
            register(Toy())

        @hookimpl
        def skip_register_schedules(register):
            register("toy_async", lambda config: None)
        """,
    )
    provides = loaded(site=tmp_path)["provides"]["skip-plugin-engines"]
    assert (provides["backends"], provides["schedules"]) == (["toy"], ["toy_async"])
    assert provides["sections"] == ["rollout.engine_kwargs.toy"]


def test_two_plugins_registering_one_role_is_an_error(tmp_path):
    install_distribution(
        tmp_path,
        "skip-plugin-impostor",
        "skip_plugin_impostor",
        """
        from skip_core import Role, hookimpl

        @hookimpl
        def skip_register_roles(register):
            register(Role(name="rollout"))
        """,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    code = "from skip_core.plugins import registry; registry()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "PluginConflict: role 'rollout' is registered by both" in done.stderr
    assert "SKIP_PLUGINS=" in done.stderr


def heavy_modules(statement: str, prefixes: tuple[str, ...]) -> list[str]:
    # Modules loaded at start-up (a ``.pth`` hook such as skip-plugin-verl's) are not the statement's.
    listing = f"sorted(m for m in set(sys.modules) - before if m.startswith({prefixes!r}))"
    code = f"import json, sys\nbefore = set(sys.modules)\n{statement}\nprint(json.dumps({listing}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_core_imports_no_plugin_and_no_torch():
    assert heavy_modules("import skip_core", ("skip_plugin", "torch")) == []


def test_the_command_loads_plugins_for_their_commands_but_no_heavy_library():
    """`skip` builds its command tree from plugins on every start: it must stay quick."""
    loaded = heavy_modules("import skip_core.cli", ("skip_plugin", "torch", "transformers", "pyarrow", "matplotlib"))
    assert "skip_plugin_profiling.cli" in loaded
    assert [m for m in loaded if not m.startswith("skip_plugin")] == []
