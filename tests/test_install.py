"""skip installed as the README says (``pip install ./core ./plugins/trainer ./plugins/arithmetic
./plugins/hf``), not editable, and run from a directory of the user's: the Hydra configs and the
tools YAML come from the installed distributions, and the relative paths of the shipped configs
(``./runs/...``) land in the working directory.

The distributions are built from copies of the checkout (a build writes ``build/`` beside its
sources) and installed into a private ``--target`` directory put first on ``PYTHONPATH`` for the
commands, so the test environment's editable installs stay untouched. The run uses the session's
embedded default (``task.dir``): building it from scratch takes minutes and is not what is tested.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from skiptests import ROOT
from training import SMALL

pytestmark = pytest.mark.integration

DISTRIBUTIONS = ("core", "plugins/trainer", "plugins/arithmetic", "plugins/hf")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    sources = tmp_path_factory.mktemp("sources")
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests")
    copies = [shutil.copytree(ROOT / folder, sources / folder, ignore=ignore) for folder in DISTRIBUTIONS]
    site = tmp_path_factory.mktemp("site")
    pip = (sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps")
    run(*pip, "--no-build-isolation", "--no-index", "--target", site, *copies, cwd=sources, site=None)
    return site


def run(*command: str | Path, cwd: Path, site: Path | None, timeout: int = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("SKIP_PLUGINS", "RAY_ADDRESS")}
    env["COLUMNS"] = "200"
    if site is not None:
        env["PYTHONPATH"] = str(site)
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{command} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_commands_run_from_the_installed_distributions(site, tmp_path):
    where = "import skip_plugin_trainer.config as c, skip_plugin_arithmetic as a; print(c.__file__, a.__file__)"
    files = run(sys.executable, "-c", where, cwd=tmp_path, site=site).split()
    assert all(Path(file).is_relative_to(site) for file in files), files
    shipped = sorted(path.name for path in (site / "skip_plugin_trainer" / "config").glob("*.yaml"))
    assert shipped == ["long_tail.yaml", "rollout.yaml", "run.yaml"]
    compose = "from skip_plugin_trainer.commands import compose_config as c; print(c(None, 'long_tail', ()).task.dir)"
    assert run(sys.executable, "-c", compose, cwd=tmp_path, site=site).strip() == "./runs/embedded_long_tail"
    assert (site / "skip_plugin_arithmetic" / "calculator.yaml").is_file()


def test_skip_run_from_an_empty_directory(site, task_dir, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    overrides = [*SMALL, f"task.dir={task_dir}", "trainer.total_training_steps=1", "trainer.test_freq=1"]
    output = run(site / "bin" / "skip", "run", *overrides, cwd=project, site=site)
    assert "run directory runs/skip/embedded" in output
    rows = [json.loads(line) for line in (project / "runs/skip/embedded/metrics.jsonl").read_text().splitlines()]
    # Every training row names the calculator, which only the shipped tools YAML configures: a run
    # that did not find it fails before step 1.
    assert [row["step"] for row in rows] == [1]
    assert (project / "runs/skip/embedded/global_step_1/manifest.json").is_file()


def test_skip_rollout_with_a_config_of_the_users_own_that_includes_the_shipped_one(site, task_dir, tmp_path):
    project = tmp_path / "project"
    (project / "conf").mkdir(parents=True)
    (project / "conf" / "mine.yaml").write_text("defaults:\n  - rollout\n  - _self_\n\nrollout:\n  n: 3\n")
    command = [site / "bin" / "skip", "rollout", "--config-dir", "conf", "--config-name", "mine"]
    task = [option for option in SMALL if option.startswith("task.")]  # the session's task, as built
    small = [
        *task,
        f"task.dir={task_dir}",
        "data.train_batch_size=4",
        "data.max_response_length=64",
        "output_dir=batch",
    ]
    output = run(*command, *small, cwd=project, site=site)
    assert "4 × 3 = 12 requests" in output
    assert list((project / "batch").rglob("meta.json")), "the batch was saved under the working directory"
