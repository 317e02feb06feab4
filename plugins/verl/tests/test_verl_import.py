"""``skip cache import-verl``: real verl 0.9.1 dumps (tests/data/verl) become skip entries.

The fixtures were written by verl itself (tests/data/verl/make_fixture.py); their content is
``make_fixture.rollout_output(step)``, so the expected batches are rebuilt here without verl.
"""

import importlib.util
import json
import os
import pickle
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from skip_core import Batch, SkipManager
from skip_core.cli import cli
from skip_core.config import Namespace
from skip_plugin_verl.verl_import import (
    UnsafePickleError,
    VerlDumpError,
    import_verl,
    read_gen_batch,
    split_run_name,
)

DATA = Path(__file__).parent / "data" / "verl"
_spec = importlib.util.spec_from_file_location("make_fixture", DATA / "make_fixture.py")
fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture)

RUN = f"{fixture.EXPERIMENT}_{fixture.PROJECT}"
SHAPE = f"GBS{fixture.GBS}_N{fixture.N}_in{fixture.PROMPT_LEN}_out{fixture.RESPONSE_LEN}"
DEFAULT_DUMP = DATA / "dump_default"


def expected(step: int) -> Batch:
    return Batch(*fixture.rollout_output(step))


def step_dir(root: Path, step: int, run: str = RUN) -> Path:
    return root / run / SHAPE / str(step)


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


# -- decoding real verl dumps -----------------------------------------------------------------


@pytest.mark.parametrize("dump", ["dump_default", "dump_numpy"])
@pytest.mark.parametrize("step", fixture.STEPS)
def test_real_verl_dump_decodes_to_what_verl_saved(dump, step):
    batch = read_gen_batch(step_dir(DATA / dump, step) / "gen_batch.dp")
    want = expected(step)
    assert batch.equals(want), batch
    assert batch.batch["teacher_logprobs"].dtype == torch.bfloat16
    assert batch.non_tensor_batch["raw_prompt"][0][0]["content"].endswith("¿Sí?")
    assert type(batch.meta_info["timing"]["agent_loop/generate_sequences/mean"]) is np.float64


def test_fixture_is_verls_layout_and_small():
    info = json.loads((DATA / "fixture_info.json").read_text())
    assert info["verl"] == "0.9.1"
    for step in fixture.STEPS:
        assert json.loads((step_dir(DEFAULT_DUMP, step) / "meta.json").read_text()) == {"global_steps": step}
    assert sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file()) < 200_000


# -- the imported entries serve a run with the same verl config --------------------------------


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


def test_cli_imports_with_trust_pickle_and_the_result_verifies(tmp_path):
    dst = tmp_path / "skip_cache"
    runner = CliRunner()
    result = runner.invoke(cli, ["cache", "import-verl", str(DEFAULT_DUMP), str(dst), "--trust-pickle"])
    assert result.exit_code == 0, result.output
    assert "imported 2 entries" in result.output
    assert runner.invoke(cli, ["cache", "verify", str(dst)]).exit_code == 0


def test_cli_refuses_without_trust_pickle_and_reads_nothing(tmp_path):
    src, marker = tmp_path / "src", tmp_path / "pwned"
    plant(step_dir(src, 1), pickle.dumps(RunsCommand(f"touch {marker}")))
    result = CliRunner().invoke(cli, ["cache", "import-verl", str(src), str(tmp_path / "out")])
    assert result.exit_code == 2 and "--trust-pickle" in result.output
    assert not (tmp_path / "out").exists() and not marker.exists()


# -- hostile pickles ----------------------------------------------------------------------------


class RunsCommand:
    """Pickles as a call of ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def plant(directory: Path, payload: bytes, meta: bool = True) -> Path:
    directory.mkdir(parents=True)
    (directory / "gen_batch.dp").write_bytes(payload)
    if meta:
        (directory / "meta.json").write_text(json.dumps({"global_steps": int(directory.name)}))
    return directory / "gen_batch.dp"


def dataproto_pickle(state: tuple) -> bytes:
    """The bytes verl's ``pickle.dump(DataProto)`` produces for ``state``, without verl."""
    body = pickle.dumps(state, protocol=3)[2:-1]  # no PROTO header, no STOP
    return b"\x80\x03cverl.protocol\nDataProto\n)\x81" + body + b"b."


def torch_saved(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


SYSTEM = f"{os.system.__module__}.system"


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (lambda cmd: pickle.dumps(RunsCommand(cmd)), SYSTEM),
        (lambda cmd: f"cos\nsystem\n(V{cmd}\ntR.".encode(), "os.system"),
        (lambda cmd: f"cbuiltins\nexec\n(Vimport os; os.system({cmd!r})\ntR.".encode(), "builtins.exec"),
        (lambda cmd: dataproto_pickle((None, {"uid": np.array([RunsCommand(cmd)], dtype=object)}, {})), SYSTEM),
        (lambda cmd: dataproto_pickle((torch_saved(RunsCommand(cmd)), {}, {})), SYSTEM),  # inside the torch.save
    ],
    ids=["reduce", "global-opcode", "builtins-exec", "in-non-tensor-batch", "in-torch-save-batch"],
)
def test_a_pickle_that_would_run_code_is_refused_without_side_effect(tmp_path, payload, named):
    src, marker = tmp_path / "src", tmp_path / "pwned"
    evil = plant(step_dir(src, 7), payload(f"touch {marker}"))
    with pytest.raises(UnsafePickleError, match=f"refusing to load global {named}"):
        read_gen_batch(evil)
    written, output = collect(src, tmp_path / "dst")
    assert not written and written.failed[0][0] == evil
    assert f"error: {evil}: refusing to load global {named}" in output
    assert not marker.exists()
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    "payload",
    [
        b"cverl.protocol\nDataProto\nN}V__setstate__\ncbuiltins\nprint\ns\x86b.",  # needs builtins: refused
        b"cverl.protocol\nDataProto\nN}V__setstate__\nctorch\nSize\ns\x86b.",  # setattr on the class
        b"cnumpy._core.numeric\n_frombuffer\nN}V__defaults__\n)s\x86b.",  # setattr on numpy's function
        b"cnumpy._core.numeric\n_frombuffer\n}Vx\nI1\nsb.",  # its __dict__
    ],
    ids=["unknown-global", "class-attribute", "function-defaults", "function-dict"],
)
def test_build_cannot_modify_the_allowed_globals(tmp_path, payload):
    import numpy._core.numeric as numeric

    frombuffer = numeric._frombuffer
    defaults, attributes = frombuffer.__defaults__, dict(frombuffer.__dict__)
    path = plant(step_dir(tmp_path, 1), payload)
    with pytest.raises((UnsafePickleError, AttributeError, TypeError)):
        read_gen_batch(path)
    assert frombuffer.__defaults__ == defaults and frombuffer.__dict__ == attributes
    assert read_gen_batch(step_dir(DEFAULT_DUMP, 1) / "gen_batch.dp").equals(expected(1))


def test_a_bad_dump_is_reported_and_the_others_are_imported(tmp_path):
    src, marker = tmp_path / "src", tmp_path / "pwned"
    shutil.copytree(DEFAULT_DUMP, src)
    evil = plant(step_dir(src, 3), pickle.dumps(RunsCommand(f"touch {marker}")))
    truncated = plant(step_dir(src, 4), (step_dir(DEFAULT_DUMP, 1) / "gen_batch.dp").read_bytes()[:-100])
    written, output = collect(src, tmp_path / "dst")
    assert [p.name for p in written] == ["1", "2"]
    assert [source for source, _ in written.failed] == [evil, truncated]
    assert f"error: {truncated}: " in output
    assert output.endswith("2 of 4 verl dumps could not be imported")
    assert not marker.exists()


def test_tensors_inside_non_tensor_batch_are_refused_with_the_reason(tmp_path):
    images = np.empty(1, dtype=object)
    images[0] = {"pixel_values": torch.ones(2, 2)}
    path = plant(step_dir(tmp_path, 1), dataproto_pickle((None, {"multi_modal_inputs": images}, {})))
    with pytest.raises(UnsafePickleError, match="torch tensor inside non_tensor_batch"):
        read_gen_batch(path)


# -- other shapes of DataProto.batch --------------------------------------------------------


def test_dataproto_without_tensors(tmp_path):
    uids = np.array(["a", "b"], dtype=object)
    path = plant(step_dir(tmp_path, 1), dataproto_pickle((torch_saved(None), {"uid": uids}, {"k": 1})))
    assert read_gen_batch(path).equals(Batch({}, {"uid": uids}, {"k": 1}))


@pytest.fixture
def fake_tensordict(monkeypatch):
    """Modules named like tensordict's, so ``torch.save`` writes the globals tensordict does."""
    package, reductions, td = (types.ModuleType(n) for n in ("tensordict", "tensordict._reductions", "tensordict._td"))

    class TensorDict:
        def __init__(self, tensors, batch_size):
            self.state = {"_tensordict": tensors, "_device": None, "_batch_size": torch.Size(batch_size)}

        def __reduce__(self):
            return reductions._make_td, (TensorDict, self.state)

    def _make_td(cls, state):
        raise AssertionError("never called")

    TensorDict.__module__, TensorDict.__qualname__ = "tensordict._td", "TensorDict"
    _make_td.__module__, _make_td.__qualname__ = "tensordict._reductions", "_make_td"
    td.TensorDict, reductions._make_td = TensorDict, _make_td
    for module in (package, reductions, td):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return TensorDict


def test_unconsolidated_tensordict_of_any_dtype(tmp_path, fake_tensordict):
    # an empty TensorDict is saved this way by verl (consolidate() needs keys); any TensorDict
    # that was not consolidated pickles through _make_td with one storage per tensor
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    tensors = {
        "f32": base,
        "strided": base[:, ::2],  # a view: offset and strides kept
        "bf16": base.to(torch.bfloat16),
        "bool": base > 5,
        "u16": base.to(torch.uint16),  # saved with _rebuild_tensor_v3
        "i8": base.to(torch.int8),
    }
    td = fake_tensordict(tensors, [4])
    path = plant(step_dir(tmp_path, 1), dataproto_pickle((torch_saved(td), {}, {})))
    batch = read_gen_batch(path)
    assert batch.equals(Batch(tensors)), batch
    empty = plant(step_dir(tmp_path, 2), dataproto_pickle((torch_saved(fake_tensordict({}, [4])), {}, {})))
    assert len(read_gen_batch(empty).batch) == 0


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


def test_transfer_queue_dumps_are_skipped_with_a_note(tmp_path):
    tq = step_dir(tmp_path / "src", 1) / "0"
    tq.mkdir(parents=True)
    (tq / "tq_batch.pt").write_bytes(b"not read")
    written, output = collect(tmp_path / "src", tmp_path / "dst")
    assert not written and "rollout_tq (TransferQueue) dumps are not supported" in output
    assert "no gen_batch.dp found" in output


def test_import_verl_requires_trust_pickle(tmp_path):
    result = CliRunner().invoke(cli, ["cache", "import-verl", str(tmp_path), str(tmp_path / "out")])
    assert result.exit_code == 2 and "--trust-pickle" in result.output
    assert not (tmp_path / "out").exists()
