"""Fixtures and checks shared by every test suite of the repository: ``core/tests``,
``plugins/*/tests`` and ``tests``."""

import os
import subprocess
import sys
import tempfile

import pytest
from hypothesis.configuration import set_hypothesis_home_dir
from skip_core import SkipManager
from skip_core.plugins import load_plugins
from skiptests import ROOT, Generator, HeldDumps, sglang_on_cpu

# Python's and pytest's own caches; everything else a test writes belongs in a temporary directory.
TOOL_CACHES = ("__pycache__/", ".pytest_cache/")
_TREE = pytest.StashKey[set]()
_BUSY = pytest.StashKey[list]()
# A pure-Python busy loop that ends with the pytest process that started it (even a killed one).
BUSY_LOOP = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(100_000):
        pass
"""

# hypothesis keeps its example database and constants cache in ./.hypothesis: give it a temporary home.
_HYPOTHESIS_HOME = tempfile.TemporaryDirectory(prefix="skip-tests-hypothesis-")
set_hypothesis_home_dir(_HYPOTHESIS_HOME.name)
# vLLM's and torch.compile's caches (else ~/.cache/vllm and /tmp/torchinductor_$USER), shared by
# the session's engines, its Ray workers and its commands, which inherit the environment.
_COMPILE_CACHES = tempfile.TemporaryDirectory(prefix="skip-tests-compile-")
os.environ["VLLM_CACHE_ROOT"] = os.path.join(_COMPILE_CACHES.name, "vllm")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_COMPILE_CACHES.name, "inductor")

# SGLang on CPU, for this process and every process it starts (tests/sglang_cpu/README.md).
sglang_on_cpu()


def _tree_files() -> set[str] | None:
    """Untracked and ignored files of the checkout (the venv aside), or ``None`` outside a git checkout."""
    command = ["git", "status", "--porcelain", "--ignored", "--untracked-files=all", "--", ".", ":!.venv*"]
    try:
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {line[3:] for line in out.splitlines() if not any(cache in line for cache in TOOL_CACHES)}


def pytest_addoption(parser):
    parser.addoption(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="run N busy-loop processes beside the tests for the whole session: a loaded machine "
        "(CI runs the tests marked `loaded` this way, with --busy 2)",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "loaded: asserts an ordering that concurrency decides (processes, threads, a SIGKILL); "
        "it must pass on a busy machine, and CI runs it beside two busy-loop processes (--busy 2)",
    )


def pytest_report_header(config):
    busy = config.getoption("busy")
    return [f"busy: {busy} busy-loop processes beside the tests"] if busy else []


def pytest_sessionstart(session):
    session.config.stash[_TREE] = _tree_files()
    busy = session.config.getoption("busy")
    session.config.stash[_BUSY] = [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())]) for _ in range(busy)
    ]


def _stop_busy(config) -> bool:
    """Stop the busy loops; whether they all ran to the end (a loop that died left the machine idle)."""
    processes = config.stash.get(_BUSY, [])
    config.stash[_BUSY] = []
    ran = all(process.poll() is None for process in processes)
    for process in processes:
        process.kill()
        process.wait()
    return ran


def pytest_unconfigure(config):
    _stop_busy(config)  # also after an interrupted session


def pytest_sessionfinish(session, exitstatus):
    """Stop the busy loops; fail the run if the suite left files in the checkout: tests write
    only under temporary directories."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if not _stop_busy(session.config):
        reporter.ensure_newline()
        reporter.write_line("ERROR: a --busy process ended before the tests did", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    before = session.config.stash.get(_TREE, None)
    after = _tree_files() if before is not None else None
    stray = sorted(after - before) if after is not None else []
    if stray:
        listing = "\n  ".join(stray[:20]) + (f"\n  ... and {len(stray) - 20} more" if len(stray) > 20 else "")
        reporter.ensure_newline()
        reporter.write_line(f"ERROR: the test suite left files in the checkout:\n  {listing}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _fresh_manager():
    SkipManager.reset()
    yield
    SkipManager.reset()


@pytest.fixture
def generator() -> Generator:
    return Generator()


@pytest.fixture
def held_dumps():
    """``held_dumps(steps, fail=False)`` registers a ``HeldDumps`` for this test; all are released at the end."""
    pm = load_plugins()
    made = []

    def hold(steps, fail: bool = False) -> HeldDumps:
        made.append(HeldDumps(steps, fail))
        pm.register(made[-1])
        return made[-1]

    yield hold
    for held in made:
        for gate in held.gates.values():
            gate.set()
    SkipManager.flush()
    for held in made:
        pm.unregister(held)


@pytest.fixture(params=[0o022, 0o027, 0o077], ids=lambda m: f"umask{m:03o}")
def umask(request):
    """Each test using it runs under umask 022, 027 and 077."""
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The embedded default model and tokenizer, built once per session with a token warm-up."""
    from skip_plugin_arithmetic.task import ArithmeticOptions, ArithmeticTask

    options = ArithmeticOptions(train_size=64, val_size=8, warmup_steps=5)
    return ArithmeticTask().prepare(tmp_path_factory.mktemp("embedded"), options, progress=False).model_path


@pytest.fixture(scope="session")
def task_dir(tiny_model_dir):
    """The directory of the session's embedded default, for ``task.dir``."""
    return tiny_model_dir.parent


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every in-process training test, shut down at the end of the session.

    Its workers can build ``rollout.backend=held_hf`` (``scripted_model.HeldUntilPaused``): each
    registers it when it starts; a test's driver registers it through ``held_backend``.
    """
    import ray

    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    setup = "scripted_model.register_held_backend"
    runtime_env = {"env_vars": {"PYTHONPATH": path}, "worker_process_setup_hook": setup}
    # Ray starts its workers at nice 15: beside any other busy process they would get a
    # thirtieth of a CPU, and the suite's runs would slow down 30-fold on a loaded machine.
    system = {"worker_niceness": 0}
    from skip_plugin_trainer.train.workers import quiet_local_ray

    quiet_local_ray()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env, _system_config=system)
    yield
    ray.shutdown()


@pytest.fixture
def held_backend():
    """``rollout.backend=held_hf`` in this process for the test (the ``ray_session`` workers have it)."""
    from scripted_model import HELD, register_held_backend, unregister_held_backend

    register_held_backend()
    yield HELD
    unregister_held_backend()
