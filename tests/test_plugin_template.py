"""The plugin template renders a distribution that installs, is found through the ``skip``
entry-point group, and passes its own tests, which find its role there under its name.

The rendered plugin is installed into a private ``--target`` directory, never into the test
environment, and used from subprocesses that put that directory on ``PYTHONPATH``. The install
needs no network: it builds with the test environment's setuptools (>= 70.1, which has
``bdist_wheel`` built in).
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import copier
import pytest

pytestmark = pytest.mark.integration

TEMPLATE = Path(__file__).resolve().parents[1] / "plugin_template"


def render(destination: Path, **answers: str) -> Path:
    # plugin_template is not a git repository root, so copier copies the working-tree files
    # as they are: no tag, commit or clean tree is involved.
    copier.run_copy(str(TEMPLATE), destination, data=answers, defaults=True, unsafe=False, quiet=True)
    return destination


def run(*command: str | Path, cwd: Path, site: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "SKIP_PLUGINS"}
    env["COLUMNS"] = "200"  # rich would truncate table cells to the default 80 columns
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"{command} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """The template rendered as plugin ``judge``, and the site directory it is installed in."""
    root = tmp_path_factory.mktemp("plugin")
    project = render(root / "skip-plugin-judge", plugin_name="judge", author_name="Test Author")
    site = root / "site"
    pip = (sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check")
    run(*pip, "--no-deps", "--no-build-isolation", "--no-index", "--target", site, project, cwd=root)
    return project, site


def test_names_derive_from_plugin_name(tmp_path):
    project = render(tmp_path / "out", plugin_name="my-role", author_name="Test Author")

    pyproject = (project / "pyproject.toml").read_text().splitlines()

    assert 'name = "skip-plugin-my-role"' in pyproject
    assert 'dependencies = ["skip-core>=0.1.0"]' in pyproject
    assert pyproject[pyproject.index("[project.entry-points.skip]") + 1] == 'my_role = "skip_plugin_my_role"'
    assert (project / "skip_plugin_my_role" / "__init__.py").is_file()
    assert (project / "tests" / "test_my_role.py").is_file()


def test_the_rendered_package_is_titled_once_by_the_description(tmp_path):
    description = "skip role 'judge': replay the judge's verdicts on chosen trainer steps"
    project = render(tmp_path / "out", plugin_name="judge", author_name="Test Author", description=description)

    docstring = ast.get_docstring(ast.parse((project / "skip_plugin_judge" / "__init__.py").read_text()))
    title, blank, *body = docstring.splitlines()

    assert (title, blank) == (f"{description}.", "")
    assert [line for line in body if line.startswith(("Role ", "skip role"))] == []


def test_skip_plugins_lists_the_installed_role(installed):
    _, site = installed

    out = run(sys.executable, "-c", "from skip_core.cli import cli; cli()", "plugins", cwd=site.parent, site=site)

    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines() if "│" in line]
    assert ["skip-plugin-judge", "0.1.0", "judge", "role judge", "skip_register_roles"] in rows


def test_rendered_plugin_passes_its_own_tests(installed):
    project, site = installed

    out = run(
        sys.executable, "-m", "pytest", project / "tests", "-q", "-p", "no:cacheprovider", cwd=site.parent, site=site
    )

    assert "3 passed" in out
