"""The bridge's tests (``in_verl/``) run where the bridge lives: a venv with verl 0.9.1 and its
dependencies on the CPU torch wheel, and skip installed beside it the way the README says
(``pip install``, not editable: the ``.pth`` start-up hook is part of what is tested).

pip takes minutes to build that venv (verl, TransferQueue), so it is built once and kept
between sessions in the user's cache (``$XDG_CACHE_HOME``, else ``~/.cache``:
``skip-tests/verl-<key>``), keyed by what goes into it: the requirements, ``constraints.txt``
and the Python version. A venv is used only once complete (its ``.complete`` marker is written
last, under a lock two sessions share), so an interrupted build is rebuilt. ``SKIP_VERL_VENV=DIR``
names another directory. skip's distributions and a role rendered from ``plugin_template/``
are installed from this checkout every session, over those of the last one. The build does not
overlap other tests: running beside the suite, its disk writes made a timing-sensitive
fully_async test fail.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import copier
import pytest
import tomllib
from skiptests import ROOT

pytestmark = pytest.mark.integration

IN_VERL = Path(__file__).resolve().parent / "in_verl"
VERL = "verl==0.9.1"
# The V1 trainer's store (``tq.init`` as verl's TaskRunnerV1 calls it): verl leaves it undeclared.
TRANSFER_QUEUE = "transferqueue==0.1.11"
# verl's agent loop imports these without declaring them; its rollout servers bring them in practice.
UNDECLARED = ("cachetools", "fastapi", "uvicorn")
DISTRIBUTIONS = (
    "core",
    *(f"plugins/{role}" for role in ("rollout", "async_rollout", "reward", "old_log_prob", "ref_log_prob", "values")),
    "plugins/profiling",
    # the trainer's algorithms and defaults, checked against verl's (in_verl/test_*_match_verl.py,
    # test_verl_defaults.py, which composes skip run's config: its default backend and task too)
    "plugins/trainer",
    "plugins/hf",
    "plugins/arithmetic",
    "plugins/verl",
)
TEMPLATE_ROLE = "judge"
PIP = ("-m", "pip", "install", "--quiet", "--disable-pip-version-check")


def run(*command: str | Path, timeout: int = 900) -> None:
    done = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{command} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


REQUIREMENTS = ("torch==2.13.0", VERL, TRANSFER_QUEUE, *UNDECLARED, "pytest", "setuptools>=70.1")


def _cached_venv() -> Path:
    key = hashlib.sha256(
        "\n".join([*REQUIREMENTS, (ROOT / "constraints.txt").read_text(), sys.version]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "skip-tests"
    return cache / f"verl-{key}"


@pytest.fixture(scope="module")
def verl_venv() -> Path:
    """A venv with verl 0.9.1: ``$SKIP_VERL_VENV``, or the one kept in the user's cache."""
    kept = os.environ.get("SKIP_VERL_VENV")
    home = Path(kept or _cached_venv()).absolute()
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f"{home.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session building it: wait for its venv
        # A venv the user named is theirs as it is (one built before the marker has none).
        if not (home / ".complete").exists() and not (kept and (home / "bin" / "python").exists()):
            shutil.rmtree(home, ignore_errors=True)  # what an interrupted build left
            run(sys.executable, "-m", "venv", home)
            run(home / "bin" / "python", *PIP, "-c", ROOT / "constraints.txt", *REQUIREMENTS)
            (home / ".complete").write_text(" ".join(REQUIREMENTS) + "\n")
    return home


@pytest.fixture(scope="module")
def verl_python(verl_venv, tmp_path_factory) -> Path:
    """The venv's interpreter, with skip from this checkout and a role from plugin_template installed."""
    python = verl_venv / "bin" / "python"
    # Built from copies: a build writes build/ and *.egg-info beside the sources it builds.
    sources = tmp_path_factory.mktemp("sources")
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests")
    copies = [shutil.copytree(ROOT / folder, sources / folder, ignore=ignore) for folder in DISTRIBUTIONS]
    answers = {"plugin_name": TEMPLATE_ROLE, "author_name": "Test"}
    role = copier.run_copy(str(ROOT / "plugin_template"), sources / "role", data=answers, defaults=True, quiet=True)
    # Same version as last session's: pip would keep those, so they go first.
    installed = [tomllib.loads((copy / "pyproject.toml").read_text())["project"]["name"] for copy in copies]
    run(python, "-m", "pip", "uninstall", "--quiet", "-y", *installed, f"skip-plugin-{TEMPLATE_ROLE}")
    # profiling with what `skip profile report` reads the logs with (in_verl/test_profiling.py runs it)
    wanted = [f"{copy}[analysis]" if copy.name == "profiling" else copy for copy in copies]
    run(python, *PIP, "--no-build-isolation", "-c", ROOT / "constraints.txt", *wanted, role.dst_path)
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
    assert counts["tests"] >= 60 and counts["failures"] == counts["errors"] == counts["skipped"] == 0, (counts, output)
