"""The start-up hook in this environment, which has no verl: armed by the ``.pth`` that the
(editable) install put in site-packages, it imports nothing and changes nothing."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("skip_plugin_verl.startup")


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)


def test_every_interpreter_is_armed_and_imports_nothing_else():
    code = "import json, sys; print(json.dumps([sorted(sys.modules), [type(f).__name__ for f in sys.meta_path]]))"
    modules, finders = json.loads(python(code).stdout)

    assert [m for m in modules if m.startswith("skip")] == ["skip_plugin_verl", "skip_plugin_verl.startup"]
    assert finders[0] == "_Finder"


def test_without_verl_an_import_of_it_fails_as_it_always_does():
    done = python("import verl.utils.skip")

    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'verl'"
