"""The shape of the repository as a contract: a small core that knows no plugin, no import
cycles, and distributions that declare exactly what they import."""

import ast
import json
import re
import subprocess
import sys
from importlib.metadata import packages_distributions, requires
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from skiptests import ROOT

# Where each distribution's package lives.
PACKAGES = {"core": "skip_core", **{p.name: f"skip_plugin_{p.name}" for p in (ROOT / "plugins").iterdir()}}
# The trainer's stack: a user who installs skip-core for a cache must not get it.
TRAINER_STACK = ("ray", "transformers", "tokenizers", "matplotlib", "pyarrow", "hydra")
# Imported only when a user opts in, each behind an error that says what to install.
# skip-plugin-verl imports verl's own stack only inside verl's processes, where verl brought it
# (TransferQueue is named by its import name where it is not installed).
OPTIONAL = {
    "skip_core": {"hydra-core"},
    "skip_plugin_trainer": {"wandb"},
    "skip_plugin_verl": {"verl", "omegaconf", "ray", "transfer-queue"},
}


def modules(folder: str) -> dict[str, Path]:
    """Module name -> file, for every module of the distribution in ``folder``."""
    base = ROOT / ("core" if folder == "core" else f"plugins/{folder}")
    package = base / PACKAGES[folder]
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(base).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside functions, and ``importlib`` loads by name.

    The repository uses absolute imports only (ruff's ``TID252`` would say otherwise).
    """
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif _is_import_module(node) and node.args and isinstance(node.args[0], ast.Constant):
            found.add(node.args[0].value)
    return found


def _is_import_module(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"


def test_core_is_small():
    # A bound with room above today's size (4866 lines, issue 54), not today's count: a fix of a
    # few lines passes, a new module or hook family has to raise it and say why in its commit
    # (the bound's history, 2500 to 4820 over issues 21 to 54, is in this file's git log).
    lines = sum(len(path.read_text().splitlines()) for path in modules("core").values())
    assert lines <= 5200, f"skip-core has {lines} lines"


def test_core_imports_no_plugin_even_by_name():
    for module, path in modules("core").items():
        plugins = sorted(m for m in imports(path) if m.startswith("skip_plugin"))
        assert not plugins, f"{module} imports {plugins}"


def test_no_import_cycles_in_any_distribution_or_between_them():
    graph = {}
    for folder in PACKAGES:
        for module, path in modules(folder).items():
            graph[module] = imports(path)
    known = set(graph)
    # Importing a module first imports its parent packages: an edge back to one is not a cycle.
    edges = {m: {t for t in targets if t in known and not f"{m}.".startswith(f"{t}.")} for m, targets in graph.items()}
    cycle = _find_cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def _declared(folder: str) -> tuple[set[str], set[str]]:
    """What the distribution requires, and what its extras add (an engine built per platform)."""
    base = ROOT / ("core" if folder == "core" else f"plugins/{folder}")
    project = tomllib.loads((base / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {}).values()
    return {_name(req) for req in project["dependencies"]}, {_name(req) for reqs in extras for req in reqs}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_each_distribution_declares_exactly_what_it_imports(folder):
    owners = packages_distributions()
    package = PACKAGES[folder]
    used = set()
    for path in modules(folder).values():
        for name in imports(path):
            top = name.split(".")[0]
            if top and top != package and top not in sys.stdlib_module_names and top != "__future__":
                used.update(_name(d) for d in owners.get(top, [top]))
    used -= OPTIONAL.get(package, set())
    required, extras = _declared(folder)
    assert used - extras == required, f"imports {sorted(used)}, requires {sorted(required)}, extras {sorted(extras)}"


def _closure(distributions: list[str]) -> set[str]:
    """Every distribution pip installs for ``distributions`` here (read from the installed metadata)."""
    seen, todo = set(), list(distributions)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in map(Requirement, requires(name) or []):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(_name(requirement.name))
    return seen


def test_a_cache_role_pulls_in_nothing_of_the_trainer_stack():
    installed = _closure(["skip-core", "skip-plugin-rollout"])
    assert not installed & {"ray", "transformers", "tokenizers", "matplotlib", "pyarrow", "hydra-core"}, installed


def test_a_decorated_call_imports_nothing_of_the_trainer_stack(tmp_path):
    code = f"""
import json, sys, torch
from skip_core import Batch, SkipManager

@SkipManager.annotate(role="rollout")
def generate(prompts):
    return Batch.from_dict({{"responses": prompts.batch["input_ids"] + 1}})

SkipManager.init({{"skip": {{"rollout": {{"enable": True, "dump_dir": {str(tmp_path)!r}, "steps": [1]}}}}}})
SkipManager.set_step(1)
generate(Batch.from_dict({{"input_ids": torch.zeros(2, 3)}}))
SkipManager.flush()
generate(Batch.from_dict({{"input_ids": torch.zeros(2, 3)}}))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {TRAINER_STACK!r})))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == []
    assert list(tmp_path.rglob("meta.json")), "the call was dumped"
