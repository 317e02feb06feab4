"""``skip run`` and ``skip rollout`` with ``rollout.backend=vllm``: the real engine in the Ray rollout
worker (``skip run``) and in the command's process (``skip rollout``)."""

from click.testing import CliRunner
from skip_core.cli import cli
from skip_core.store import verify
from skiptests import CONFIGS, SMALL
from training import metrics, train

VLLM = ("rollout.backend=vllm", "rollout.engine_kwargs.vllm.enforce_eager=true")


def test_two_steps_train_with_the_engines_log_probs_close_to_the_trainers(ray_session, task_dir, tmp_path):
    trainer, output = train(task_dir, tmp_path, *VLLM, "trainer.total_training_steps=2", "trainer.test_freq=0")
    rows = metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2]
    # Step 2 samples from the weights step 1 pushed into the engine: a bad sync would show here.
    for row in rows:
        assert row["training/rollout_probs_diff_mean"] < 1e-4, row
        assert row["training/rollout_probs_diff_max"] < 1e-2, row
        assert row["response_length/mean"] > 0
    assert trainer.rollout.calls == 2 and "skip run" in output


def test_skip_rollout_writes_a_verified_batch(task_dir, tmp_path):
    args = ["rollout", "--config-dir", str(CONFIGS), *SMALL, f"task.dir={task_dir}", f"output_dir={tmp_path}", *VLLM]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (entry,) = tmp_path.glob("*/*/1")
    assert verify(entry)["samples"] == 8
    assert "tokens/s" in result.output
