import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis.configuration import set_hypothesis_home_dir
from skip_core import Batch, SkipManager, hookimpl
from skip_core.plugins import load_plugins

ROOT = Path(__file__).resolve().parent.parent
# Python's and pytest's own caches; everything else a test writes belongs in a temporary directory.
TOOL_CACHES = ("__pycache__/", ".pytest_cache/")
_TREE = pytest.StashKey[set]()

# hypothesis keeps its example database and constants cache in ./.hypothesis: give it a temporary home.
_HYPOTHESIS_HOME = tempfile.TemporaryDirectory(prefix="skip-tests-hypothesis-")
set_hypothesis_home_dir(_HYPOTHESIS_HOME.name)


def _tree_files() -> set[str] | None:
    """Untracked and ignored files of the checkout (the venv aside), or ``None`` outside a git checkout."""
    command = ["git", "status", "--porcelain", "--ignored", "--untracked-files=all", "--", ".", ":!.venv*"]
    try:
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {line[3:] for line in out.splitlines() if not any(cache in line for cache in TOOL_CACHES)}


def pytest_sessionstart(session):
    session.config.stash[_TREE] = _tree_files()


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if the suite left files in the checkout: tests write only under temporary directories."""
    before = session.config.stash.get(_TREE, None)
    after = _tree_files() if before is not None else None
    stray = sorted(after - before) if after is not None else []
    if stray:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        listing = "\n  ".join(stray[:20]) + (f"\n  ... and {len(stray) - 20} more" if len(stray) > 20 else "")
        reporter.ensure_newline()
        reporter.write_line(f"ERROR: the test suite left files in the checkout:\n  {listing}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _fresh_manager():
    SkipManager.reset()
    yield
    SkipManager.reset()


def make_prompts(n: int = 4, seed: int = 0, validate: bool = False) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return Batch.from_dict(
        tensors={"input_ids": torch.randint(0, 1000, (n, 8), generator=generator)},
        non_tensors={"raw_prompt": [f"prompt {seed}-{i}" for i in range(n)], "uid": [f"u{i}" for i in range(n)]},
        meta_info={"validate": validate},
    )


def run_config(dump_dir, /, role: str = "rollout", **section) -> dict:
    """A verl-shaped run config with one enabled role."""
    settings = {"enable": True, "dump_dir": str(dump_dir), "steps": [1, 2, 3], "action": "cache", **section}
    return {
        "skip": {role: settings},
        "trainer": {"experiment_name": "exp", "project_name": "proj"},
        "data": {"train_batch_size": 4, "max_prompt_length": 8, "max_response_length": 16},
        "actor_rollout_ref": {"rollout": {"n": 1}},
    }


class Generator:
    """A rollout stand-in whose output depends on its inputs and a per-call counter."""

    def __init__(self) -> None:
        self.calls = 0

    def output(self, prompts: Batch) -> Batch:
        self.calls += 1
        responses = prompts.batch["input_ids"] * 10 + self.calls
        return Batch.from_dict(
            {"responses": responses, "rollout_log_probs": torch.rand(responses.shape)},
            {"raw_prompt": prompts.non_tensor_batch["raw_prompt"], "call": np.array([self.calls] * len(prompts))},
            {"generated_by_call": self.calls},
        )

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        return self.output(prompts)

    @SkipManager.annotate(role="rollout")
    async def agenerate_sequences(self, prompts: Batch) -> Batch:
        return self.output(prompts)


@pytest.fixture
def generator() -> Generator:
    return Generator()


class HeldDumps:
    """Holds the dumps of chosen steps until released: a disk slower than any timing could make it.

    Registered first, it runs before core's dump; ``fail`` makes the held dumps raise once released.
    """

    def __init__(self, steps, fail: bool = False) -> None:
        self.gates = {step: threading.Event() for step in steps}
        self.fail = fail

    def release(self, step: int) -> None:
        self.gates[step].set()

    @hookimpl(tryfirst=True)
    def skip_dump(self, step):
        gate = self.gates.get(step)
        if gate is None:
            return
        gate.wait(timeout=60)
        if self.fail:
            raise OSError(f"step {step}: no space left on device")


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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The embedded default model and tokenizer, built once per session with a token warm-up."""
    from skip_core.arithmetic import ArithmeticTask

    options = {"train_size": 64, "val_size": 8, "warmup_steps": 5}
    return ArithmeticTask().prepare(tmp_path_factory.mktemp("embedded"), options, progress=False).model_path


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every in-process training test, shut down at the end of the session."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
