"""The venv the bridge's own tests run in (``in_verl/``, started by ``test_inside_verl.py``):
verl 0.9.1 with its dependencies on the CPU torch wheel.

pip takes over a minute there, so the build starts in the background, at the lowest CPU
priority, as soon as the session has collected the test that needs it, and overlaps the rest
of the suite. ``$SKIP_VERL_VENV``
names a venv to keep between sessions instead (built on first use).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from skiptests import ROOT

collect_ignore = ["in_verl"]

VERL = "verl==0.9.1"
# verl's agent loop imports these without declaring them; its rollout servers bring them in practice.
UNDECLARED = ("cachetools", "fastapi", "uvicorn")
PIP = ("-m", "pip", "install", "--quiet", "--disable-pip-version-check")
_VENV = pytest.StashKey["VerlVenv"]()


class VerlVenv:
    """This session's venv: kept (``$SKIP_VERL_VENV``), or built in the background under /tmp."""

    def __init__(self) -> None:
        kept = os.environ.get("SKIP_VERL_VENV")
        self._temporary = None if kept else tempfile.TemporaryDirectory(prefix="skip-verl-venv-")
        self.home = Path(kept or self._temporary.name).absolute() / ("" if kept else "verl")
        self.python = self.home / "bin" / "python"
        self.log = self.home.parent / f"{self.home.name}-build.log"
        self._build: subprocess.Popen | None = None

    def start(self) -> None:
        if self._build is not None or self.python.exists():
            return
        requirements = ("torch==2.13.0", VERL, *UNDECLARED, "pytest", "setuptools>=70.1")
        install = (self.python, *PIP, "-c", ROOT / "constraints.txt", *requirements)
        steps = [(sys.executable, "-m", "venv", self.home), install]
        script = " && ".join(shlex.join(map(str, step)) for step in steps)
        self.home.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            # At the lowest priority: the tests running meanwhile keep the CPUs (some of them time things).
            command = ["nice", "-n", "19", "sh", "-c", script]
            self._build = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def ready(self, timeout: float = 900) -> Path:
        """The venv's interpreter once built; a failed build fails with pip's output."""
        self.start()
        if self._build is not None and self._build.wait(timeout) != 0:
            pytest.fail(f"building the verl venv failed:\n{self.log.read_text()[-4000:]}")
        return self.python

    def close(self) -> None:
        if self._build is not None and self._build.poll() is None:
            self._build.kill()
            self._build.wait()
        if self._temporary is not None:
            self._temporary.cleanup()


def pytest_collection_finish(session):
    if any(item.path.name == "test_inside_verl.py" for item in session.items):
        session.config.stash[_VENV] = VerlVenv()
        session.config.stash[_VENV].start()


def pytest_unconfigure(config):
    if _VENV in config.stash:
        config.stash[_VENV].close()


@pytest.fixture(scope="session")
def verl_venv(request) -> VerlVenv:
    if _VENV not in request.config.stash:
        request.config.stash[_VENV] = VerlVenv()
    return request.config.stash[_VENV]
