"""``skip cache import-verl``: real verl 0.9.1 dumps (tests/data/verl) become skip entries.

The fixtures were written by verl itself (tests/data/verl/make_fixture.py); their content is
``make_fixture.rollout_output(step)``, so the expected batches are rebuilt here without verl.
How a single ``gen_batch.dp`` is decoded is specified in test_verl_pickle.py.
"""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from skip_core import Batch, SkipManager
from skip_core.cli import cli
from skip_core.config import Namespace
from skip_plugin_verl.dumps.errors import VerlDumpError
from skip_plugin_verl.dumps.importing import import_verl, split_run_name

DATA = Path(__file__).parent / "data" / "verl"
_spec = importlib.util.spec_from_file_location("make_fixture", DATA / "make_fixture.py")
fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture)

DEFAULT_DUMP = DATA / "dump_default"
step_dir = fixture.step_dir


def expected(step: int) -> Batch:
    return Batch(*fixture.rollout_output(step))


def collect(src, dst, **kwargs):
    lines = []
    written = import_verl(src, dst, echo=lines.append, **kwargs)
    return written, "\n".join(lines)


def run_config(dst: Path, steps=fixture.STEPS) -> dict:
    """The skip config of a run with the fixture's verl settings (and so its namespace)."""
    config = fixture.run_config(str(dst))
    config["skip"]["rollout"]["steps"] = list(steps)
    del config["trainer"]["v1"]
    return config


class Rollout:
    def __init__(self) -> None:
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls += 1
        return Batch.from_dict({"responses": torch.zeros(len(prompts), 1, dtype=torch.long)})


def prompts() -> Batch:
    return Batch.from_dict({"input_ids": torch.ones(fixture.GBS * fixture.N, fixture.PROMPT_LEN, dtype=torch.long)})


def plant(directory: Path, payload: bytes) -> Path:
    """A ``gen_batch.dp`` holding ``payload``, in verl's layout with its ``meta.json``."""
    directory.mkdir(parents=True)
    (directory / "gen_batch.dp").write_bytes(payload)
    (directory / "meta.json").write_text(json.dumps({"global_steps": int(directory.name)}))
    return directory / "gen_batch.dp"


def runs_touch(marker: Path) -> bytes:
    """A pickle that runs ``touch marker`` when loaded by ``pickle.load``."""
    return f"cos\nsystem\n(Vtouch {marker}\ntR.".encode()


# -- the imported entries serve a run with the same verl config --------------------------------


def test_fixture_is_verls_layout_and_small():
    info = json.loads((DATA / "fixture_info.json").read_text())
    assert info["verl"] == "0.9.1"
    for step in fixture.STEPS:
        assert json.loads((step_dir(DEFAULT_DUMP, step) / "meta.json").read_text()) == {"global_steps": step}
    assert sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file()) < 200_000


def test_imported_steps_are_served_by_skip_manager_without_running(tmp_path):
    dst = tmp_path / "skip_cache"
    written, output = collect(DEFAULT_DUMP, dst)
    assert [p.name for p in written] == ["1", "2"] and not written.failed
    assert f"{step_dir(DEFAULT_DUMP, 1) / 'gen_batch.dp'} -> {step_dir(dst, 1)} (4 samples, step 1)" in output

    config = run_config(dst, steps=[1, 2, 3])
    meta = json.loads((step_dir(dst, 1) / "meta.json").read_text())
    assert meta["namespace"] == vars(Namespace.from_config(config)) and meta["role"] == "rollout"

    SkipManager.init(config)
    rollout = Rollout()
    for step in fixture.STEPS:
        SkipManager.set_step(step)
        served = rollout.generate_sequences(prompts())
        assert rollout.calls == 0
        want = expected(step)
        assert served.select(meta_info_keys=[]).equals(want.select(meta_info_keys=[]))  # tensors, non-tensors
        assert served.meta_info == want.meta_info  # by value: data.json keeps np.float64 as a float
    SkipManager.set_step(3)  # listed but never dumped by verl: generated
    rollout.generate_sequences(prompts())
    assert rollout.calls == 1


def test_a_run_with_other_settings_does_not_use_the_entries(tmp_path):
    dst = tmp_path / "skip_cache"
    collect(DEFAULT_DUMP, dst)
    config = run_config(dst)
    config["actor_rollout_ref"]["rollout"]["n"] = fixture.N + 1  # another namespace
    SkipManager.init(config)
    SkipManager.set_step(1)
    rollout = Rollout()
    rollout.generate_sequences(prompts())
    assert rollout.calls == 1


def test_importing_again_replaces_the_entries_and_says_so(tmp_path):
    dst = tmp_path / "skip_cache"
    collect(DEFAULT_DUMP, dst)
    written, output = collect(DEFAULT_DUMP, dst)
    assert [p.name for p in written] == ["1", "2"]
    assert output.count(", replaced the existing entry)") == 2


# -- the command ----------------------------------------------------------------------------


def test_cli_imports_with_trust_pickle_and_the_result_verifies(tmp_path):
    dst = tmp_path / "skip_cache"
    runner = CliRunner()
    result = runner.invoke(cli, ["cache", "import-verl", str(DEFAULT_DUMP), str(dst), "--trust-pickle"])
    assert result.exit_code == 0, result.output
    assert "imported 2 entries" in result.output
    assert runner.invoke(cli, ["cache", "verify", str(dst)]).exit_code == 0


def test_cli_refuses_without_trust_pickle_and_reads_nothing(tmp_path):
    src, marker = tmp_path / "src", tmp_path / "pwned"
    plant(step_dir(src, 1), runs_touch(marker))
    result = CliRunner().invoke(cli, ["cache", "import-verl", str(src), str(tmp_path / "out")])
    assert result.exit_code == 2 and "--trust-pickle" in result.output
    assert not (tmp_path / "out").exists() and not marker.exists()


def test_a_bad_dump_is_reported_and_the_others_are_imported(tmp_path):
    src, dst, marker = tmp_path / "src", tmp_path / "dst", tmp_path / "pwned"
    shutil.copytree(DEFAULT_DUMP, src)
    evil = plant(step_dir(src, 3), runs_touch(marker))
    truncated = plant(step_dir(src, 4), (step_dir(DEFAULT_DUMP, 1) / "gen_batch.dp").read_bytes()[:-100])
    written, output = collect(src, dst)
    assert [p.name for p in written] == ["1", "2"]
    assert [source for source, _ in written.failed] == [evil, truncated]
    assert f"error: {evil}: refusing to load global os.system" in output
    assert f"error: {truncated}: " in output
    assert output.endswith("2 of 4 verl dumps could not be imported")
    assert not marker.exists()
    assert not step_dir(dst, 3).exists() and not step_dir(dst, 4).exists()


def test_each_failure_is_one_line_with_control_characters_escaped(tmp_path):
    # a run directory whose name clears the screen and breaks the line, named again in the reason
    src, marker = tmp_path / "src", tmp_path / "pwned"
    evil = plant(step_dir(src, 1, run="exp\x1b[2J\n_proj"), runs_touch(marker))
    result = CliRunner().invoke(cli, ["cache", "import-verl", str(src), str(tmp_path / "dst"), "--trust-pickle"])
    assert result.exit_code == 1 and not marker.exists()
    escaped = str(evil).replace("\x1b", "\\x1b").replace("\n", "\\x0a")
    assert result.output.splitlines() == [
        f"error: {escaped}: refusing to load global os.system from {escaped}: a verl rollout dump only references "
        "DataProto, numpy arrays and tensordict/torch tensor rebuilds; this file was not written by verl's rollout "
        "skip or was tampered with",
        "1 of 1 verl dumps could not be imported",
        f"imported 0 entries into {tmp_path / 'dst'}",
    ]


def test_a_dump_below_a_tree_deeper_than_the_recursion_limit_is_found(tmp_path):
    from skip_core.files import delete_tree
    from skiptests import deep_tree

    top = deep_tree(tmp_path / "src")
    try:
        step = step_dir(top / "/".join(["d"] * 1_100), 1)
        step.mkdir(parents=True)  # three levels: below the recursion limit
        for name in ("gen_batch.dp", "meta.json"):
            shutil.copy(step_dir(DEFAULT_DUMP, 1) / name, step / name)
        written, output = collect(top, tmp_path / "dst")  # os.walk raised RecursionError out of the command
        assert [p.name for p in written] == ["1"] and not written.failed, output
    finally:  # pytest's clean-up of old temporary directories recurses
        delete_tree(top)


def test_a_transfer_queue_dump_that_is_no_torch_archive_is_reported(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(DEFAULT_DUMP, src)
    tq = step_dir(src, 1) / "0"
    tq.mkdir()
    (tq / "tq_batch.pt").write_bytes(b"not read")
    (tq / "meta.json").write_text(json.dumps({"global_steps": 1, "num_trajectories": 4}))
    written, output = collect(src, tmp_path / "dst")
    assert [p.name for p in written] == ["1", "2"]
    assert f"error: {tq / 'tq_batch.pt'}: " in output and "is not a torch zip archive" in output


def test_pipes_named_like_dumps_are_reported_and_never_waited_on(tmp_path):
    import os

    src = tmp_path / "src"
    shutil.copytree(DEFAULT_DUMP, src)
    tq = step_dir(src, 1) / "0"
    tq.mkdir()
    os.mkfifo(tq / "tq_batch.pt")  # no writer: a plain open() would wait forever
    (tq / "meta.json").write_text(json.dumps({"global_steps": 1}))
    (step_dir(src, 2) / "gen_batch.dp").unlink()
    os.mkfifo(step_dir(src, 2) / "gen_batch.dp")
    written, output = collect(src, tmp_path / "dst")
    assert [p.name for p in written] == ["1"]
    assert output.count("is not a regular file (a named pipe)") == 2


# -- verl's directory names -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("run", "experiment", "project", "split"),
    [
        ("exp_proj", None, None, ("exp", "proj")),
        ("gsm8k_verl_examples", "gsm8k", None, ("gsm8k", "verl_examples")),
        ("gsm8k_verl_examples", None, "examples", ("gsm8k_verl", "examples")),
        ("a_b_c", "a_b", "c", ("a_b", "c")),
        ("_proj", None, None, ("", "proj")),
    ],
)
def test_split_run_name(run, experiment, project, split):
    assert split_run_name(run, experiment, project) == split


@pytest.mark.parametrize(
    ("run", "experiment", "project", "message"),
    [
        ("gsm8k_verl_examples", None, None, "--experiment-name / --project-name"),
        ("noseparator", None, None, "is not verl's"),
        ("exp_proj", "other", None, "does not start with experiment name 'other'"),
        ("exp_proj", None, "other", "does not end with '_' \\+ project name 'other'"),
        ("exp_proj", "exp", "other", "is not experiment 'exp'"),
    ],
)
def test_split_run_name_refuses_what_it_cannot_tell(run, experiment, project, message):
    with pytest.raises(VerlDumpError, match=message):
        split_run_name(run, experiment, project)


def test_ambiguous_run_directory_needs_the_experiment_name(tmp_path):
    run = "gsm8k_grpo_verl_examples"  # verl's default project name has an underscore
    src = tmp_path / "src"
    shutil.copytree(step_dir(DEFAULT_DUMP, 1), step_dir(src, 1, run))
    written, output = collect(src, tmp_path / "dst")
    assert not written and "cannot tell experiment_name from project_name" in output
    assert "'gsm8k' + 'grpo_verl_examples', 'gsm8k_grpo' + 'verl_examples', 'gsm8k_grpo_verl' + 'examples'" in output

    written, _ = collect(src, tmp_path / "dst", experiment_name="gsm8k_grpo")
    meta = json.loads((written[0] / "meta.json").read_text())
    assert meta["namespace"]["experiment_name"] == "gsm8k_grpo"
    assert meta["namespace"]["project_name"] == "verl_examples"
    assert meta["namespace"]["gbs"] == fixture.GBS and meta["namespace"]["n"] == fixture.N


def test_names_in_verl_meta_json_settle_the_split(tmp_path):
    src = tmp_path / "src"
    target = step_dir(src, 1, "a_b_c")
    shutil.copytree(step_dir(DEFAULT_DUMP, 1), target)
    (target / "meta.json").write_text(json.dumps({"global_steps": 1, "experiment_name": "a", "project_name": "b_c"}))
    written, _ = collect(src, tmp_path / "dst")
    assert json.loads((written[0] / "meta.json").read_text())["namespace"]["project_name"] == "b_c"


def test_the_directory_names_the_step_when_meta_json_disagrees(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(step_dir(DEFAULT_DUMP, 1), step_dir(src, 5))
    written, output = collect(src, tmp_path / "dst")
    assert [p.name for p in written] == ["5"]
    assert "warning: " in output and "meta.json records global_steps 1; using the directory's step 5" in output


def test_a_step_without_verl_meta_json_is_incomplete(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(DEFAULT_DUMP, src)
    (step_dir(src, 2) / "meta.json").unlink()
    written, output = collect(src, tmp_path / "dst")
    assert [p.name for p in written] == ["1"]
    assert "incomplete verl dump" in output


def test_a_file_outside_verls_layout_is_reported(tmp_path):
    shutil.copy(step_dir(DEFAULT_DUMP, 1) / "gen_batch.dp", tmp_path / "gen_batch.dp")
    written, output = collect(tmp_path, tmp_path / "dst")
    assert not written and "not in verl's layout" in output


def test_importing_into_the_verl_dump_itself_is_refused(tmp_path):
    src = tmp_path / "dump"
    shutil.copytree(DEFAULT_DUMP, src)
    written, output = collect(src, src)
    assert not written and "choose another DST" in output
    assert (step_dir(src, 1) / "gen_batch.dp").exists()


def test_two_dumps_of_one_namespace_and_step_are_not_merged_silently(tmp_path):
    # dump_default and dump_numpy hold the same run: the first of each step wins
    written, output = collect(DATA, tmp_path / "dst")
    assert len(written) == 2 and len(written.failed) == 2
    assert "was already imported into" in output
    assert str(step_dir(DEFAULT_DUMP, 1)) in output
