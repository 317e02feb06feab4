"""The bridge's tests (``in_verl/``) run where the bridge lives: a venv with verl 0.9.1 on the CPU
torch wheel (``conftest.VerlVenv``), and skip installed beside it the way the README says
(``pip install``, not editable: the ``.pth`` start-up hook is part of what is tested).
skip's distributions and a role rendered from ``plugin_template/`` are installed from this
checkout every session.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from xml.etree import ElementTree

import copier
import pytest
from skiptests import ROOT

pytestmark = pytest.mark.slow

IN_VERL = Path(__file__).resolve().parent / "in_verl"
DISTRIBUTIONS = ("core", "plugins/rollout", "plugins/async_rollout", "plugins/verl")
TEMPLATE_ROLE = "judge"
PIP = ("-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-build-isolation")


@pytest.fixture(scope="module")
def verl_python(verl_venv, tmp_path_factory) -> Path:
    """The venv's interpreter, with skip from this checkout and a role from plugin_template installed."""
    python = verl_venv.ready()
    # Built from copies: a build writes build/ and *.egg-info beside the sources it builds.
    sources = tmp_path_factory.mktemp("sources")
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests")
    copies = [shutil.copytree(ROOT / folder, sources / folder, ignore=ignore) for folder in DISTRIBUTIONS]
    answers = {"plugin_name": TEMPLATE_ROLE, "author_name": "Test"}
    role = copier.run_copy(str(ROOT / "plugin_template"), sources / "role", data=answers, defaults=True, quiet=True)
    command = [python, *PIP, "-c", ROOT / "constraints.txt", *copies, role.dst_path]
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return python


def test_the_bridge_inside_verl(verl_python, tmp_path):
    report = tmp_path / "report.xml"
    environment = {k: v for k, v in os.environ.items() if k not in ("SKIP_PLUGINS", "RAY_ADDRESS", "PYTHONPATH")}
    environment["SKIP_TEST_TEMPLATE_ROLE"] = TEMPLATE_ROLE
    command = [verl_python, "-m", "pytest", IN_VERL, "-q", f"--junitxml={report}", f"--basetemp={tmp_path / 'tmp'}"]
    done = subprocess.run(
        list(map(str, command)), cwd=IN_VERL, env=environment, capture_output=True, text=True, timeout=900, check=False
    )

    output = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, output
    suite = ElementTree.parse(report).getroot().find("testsuite")
    counts = {key: int(suite.get(key)) for key in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= 15 and counts["failures"] == counts["errors"] == counts["skipped"] == 0, (counts, output)
