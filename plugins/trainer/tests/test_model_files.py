"""A model directory read as hostile before transformers parses it (``model_files.py``): the
student's and the teacher's, refused in one line naming the key and the file; a directory of
links, as the hub's cache lays a snapshot out, read through them."""

import os
import shutil

import pytest
from click.testing import CliRunner
from skip_core.cli import cli
from skip_core.config import ConfigError
from skip_plugin_trainer import model_files
from skip_plugin_trainer.memory import Shape

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError, far from the file


def copy_model(source, target, **replaced: str):
    """``source``'s files in ``target``, with ``replaced``'s (file name: text) written instead."""
    target.mkdir()
    for name in os.listdir(source):
        shutil.copy(source / name, target)
    for name, text in replaced.items():
        (target / name).unlink(missing_ok=True)
        (target / name).write_text(text)
    return target


def check(*args: str) -> str:
    result = CliRunner().invoke(cli, ["run", "--check", *args])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    return error


def own_model(task_dir, path) -> list[str]:
    data = task_dir / "data"
    return ["task.name=null", f"model.path={path}", f"data.train_files=[{data / 'train.parquet'}]",
            f"data.val_files=[{data / 'val.parquet'}]"]  # fmt: skip


def test_a_model_nested_too_deep_is_one_line_naming_model_path(task_dir, tmp_path):
    model = copy_model(task_dir / "model", tmp_path / "model", **{"tokenizer_config.json": DEEP})
    error = check(*own_model(task_dir, model))
    assert error.startswith(f"Error: model.path: {model / 'tokenizer_config.json'}: "), error
    assert "nested 100000 levels deep" in error


@pytest.mark.parametrize("planted", ["pipe", "device"])
def test_a_teacher_whose_config_never_ends_is_one_line_naming_the_teacher(task_dir, tmp_path, planted):
    teacher = copy_model(task_dir / "model", tmp_path / "teacher")
    (teacher / "generation_config.json").unlink()
    if planted == "pipe":
        os.mkfifo(teacher / "generation_config.json")  # a read would wait for a writer forever
    else:
        os.symlink("/dev/zero", teacher / "generation_config.json")  # a read would never end
    teaching = f"+distillation.teacher_models.t.model_path={teacher}"
    error = check(f"task.dir={task_dir}", "distillation.enabled=true", teaching)
    assert error.startswith(f"Error: distillation.teacher_models: {teacher / 'generation_config.json'}: "), error
    assert "is not a regular file" in error


def test_a_directory_of_links_is_read_through_them(task_dir, tmp_path):
    """The hub's cache: ``snapshots/<revision>/config.json`` links to ``blobs/<hash>``."""
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for name in os.listdir(task_dir / "model"):
        os.symlink(task_dir / "model" / name, snapshot / name)
    model_files.check(snapshot, "model.path")
    assert Shape.read(snapshot) == Shape.read(task_dir / "model")
    (snapshot / "config.json").unlink()
    (tmp_path / "blob").write_text(f'{{"a": {DEEP}}}')
    os.symlink(tmp_path / "blob", snapshot / "config.json")
    with pytest.raises(ConfigError, match=r"^model\.path: .*config\.json: blob: nested"):
        model_files.check(snapshot, "model.path")
