"""verl's on-policy distillation under ``skip run``: the teacher's log-probs of the sampled
tokens reach the actor's loss, which pulls the student toward them (the loss itself is checked
against verl's function in the verl venv: ``test_distillation_matches_verl.py``)."""

import pytest
from skip_core import ConfigError
from skip_plugin_trainer.commands import compose_config
from skip_plugin_trainer.config.settings import RunSettings
from skiptests import CONFIGS
from training import metrics, overrides, train, undeclared_phases


def distilling(task_dir, tmp_path, *more: str) -> list[str]:
    """Two steps distilling from the starting weights, rewarded by the responses' lengths: the
    session's tiny model scores 0 on every sample, which would leave the task's loss at 0."""
    reward = tmp_path / "lengths.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 3)\n")  # fmt: skip
    teacher = f"+distillation.teacher_models.teacher_model.model_path={task_dir / 'model'}"
    steps = ["trainer.total_training_steps=2", "trainer.resume_mode=disable", f"+custom_reward_function.path={reward}"]
    return [*steps, "distillation.enabled=true", teacher, *more]


@pytest.mark.integration  # two runs
def test_a_student_that_is_its_teacher_has_nothing_to_learn_until_the_task_moves_it(ray_session, task_dir, tmp_path):
    """The teacher is the student's own starting weights: the divergence starts at 0. Without
    the task's rewards nothing moves the student from it (k3's gradient is 0 there); with them,
    the first update moves it and the second step's divergence is positive."""
    only = distilling(task_dir, tmp_path, "distillation.distillation_loss.use_task_rewards=false")
    alone, _ = train(task_dir, tmp_path / "alone", *only)
    rows = metrics(tmp_path / "alone" / "run")
    assert len(rows) == 2 and all(abs(row["distillation/loss"]) < 1e-6 for row in rows)
    assert all(row["actor/grad_norm"] < 1e-6 for row in rows)  # the task's loss is left out
    assert all("timing_s/teacher" in row for row in rows) and not undeclared_phases(alone, rows)
    train(task_dir, tmp_path / "task", *distilling(task_dir, tmp_path))
    first, second = metrics(tmp_path / "task" / "run")
    assert first["actor/grad_norm"] > 0  # the task moved the student
    assert abs(first["distillation/loss"]) < 1e-6 < second["distillation/loss"]
    assert second["distillation/abs_loss"] > 0


@pytest.mark.parametrize(
    ("more", "message"),
    [
        ([], r"^distillation\.teacher_models: skip distills from one teacher, got 0"),
        (
            ["+distillation.distillation_loss.loss_mode=forward_kl_topk"],
            r"loss_mode: forward_kl_topk is not implemented",
        ),
    ],
)
def test_what_skip_cannot_distill_is_one_line(task_dir, tmp_path, more, message):
    config = compose_config(CONFIGS, "run", tuple(overrides(task_dir, tmp_path, "distillation.enabled=true", *more)))
    with pytest.raises(ConfigError, match=message):
        RunSettings.from_config(config)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(task_dir, tmp_path):
    from skip_plugin_trainer.train.preflight import check_teacher
    from transformers import AutoTokenizer
    from word_chat import word_tokenizer

    word_tokenizer().save_pretrained(tmp_path / "words")
    check_teacher(str(task_dir / "model"), AutoTokenizer.from_pretrained(task_dir / "model"))  # its own: fine
    with pytest.raises(ConfigError, match=r"the teacher's tokenizer \(.*words, 71 tokens\) is not the student's"):
        check_teacher(str(tmp_path / "words"), AutoTokenizer.from_pretrained(task_dir / "model"))
