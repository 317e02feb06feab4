"""Reading verl's ``gen_batch.dp``: what verl 0.9.1 saved comes back, and nothing in the pickle runs.

The fixtures were written by verl itself (tests/data/verl/make_fixture.py); their content is
``make_fixture.rollout_output(step)``, so the expected batches are rebuilt here without verl.
The hostile and unusual pickles are made here, without verl, the way verl would write them.
"""

import importlib.util
import io
import os
import pickle
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from skip_core import Batch
from skip_plugin_verl.dumps.errors import UnsafePickleError, VerlDumpError
from skip_plugin_verl.dumps.verl_pickle import read_gen_batch

DATA = Path(__file__).parent / "data" / "verl"
_spec = importlib.util.spec_from_file_location("make_fixture", DATA / "make_fixture.py")
fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture)


def real_dump(step: int, dump: str = "dump_default") -> Path:
    return fixture.step_dir(DATA / dump, step) / "gen_batch.dp"


def expected(step: int) -> Batch:
    return Batch(*fixture.rollout_output(step))


def written(tmp_path: Path, payload: bytes) -> Path:
    path = tmp_path / "gen_batch.dp"
    path.write_bytes(payload)
    return path


def dataproto_pickle(state: tuple) -> bytes:
    """The bytes verl's ``pickle.dump(DataProto)`` produces for ``state``, without verl."""
    body = pickle.dumps(state, protocol=3)[2:-1]  # no PROTO header, no STOP
    return b"\x80\x03cverl.protocol\nDataProto\n)\x81" + body + b"b."


def torch_saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# -- real verl dumps ------------------------------------------------------------------------


@pytest.mark.parametrize("dump", ["dump_default", "dump_numpy"])
@pytest.mark.parametrize("step", fixture.STEPS)
def test_real_verl_dump_decodes_to_what_verl_saved(dump, step):
    batch = read_gen_batch(real_dump(step, dump))
    assert batch.equals(expected(step)), batch
    assert batch.batch["teacher_logprobs"].dtype == torch.bfloat16
    assert batch.non_tensor_batch["raw_prompt"][0][0]["content"].endswith("¿Sí?")
    assert type(batch.meta_info["timing"]["agent_loop/generate_sequences/mean"]) is np.float64


# -- hostile pickles ------------------------------------------------------------------------


class RunsCommand:
    """Pickles as a call of ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


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
def test_a_pickle_that_would_run_code_is_refused_naming_the_global(tmp_path, payload, named):
    marker = tmp_path / "pwned"
    evil = written(tmp_path, payload(f"touch {marker}"))
    with pytest.raises(UnsafePickleError, match=f"refusing to load global {named} from {evil}"):
        read_gen_batch(evil)
    assert not marker.exists()


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
    with pytest.raises(UnsafePickleError):  # the reader's own error, whatever BUILD tried
        read_gen_batch(written(tmp_path, payload))
    assert frombuffer.__defaults__ == defaults and frombuffer.__dict__ == attributes
    assert read_gen_batch(real_dump(1)).equals(expected(1))


def test_tensors_inside_non_tensor_batch_are_refused_with_the_reason(tmp_path):
    images = np.empty(1, dtype=object)
    images[0] = {"pixel_values": torch.ones(2, 2)}
    path = written(tmp_path, dataproto_pickle((None, {"multi_modal_inputs": images}, {})))
    with pytest.raises(UnsafePickleError, match="torch tensor inside non_tensor_batch"):
        read_gen_batch(path)


def test_a_truncated_dump_is_an_error(tmp_path):
    with pytest.raises(UnsafePickleError, match=r"gen_batch\.dp: FRAME at byte 2 declares 6373 bytes, past the end"):
        read_gen_batch(written(tmp_path, real_dump(1).read_bytes()[:-100]))


# -- other shapes of DataProto.batch --------------------------------------------------------


def test_dataproto_without_tensors(tmp_path):
    uids = np.array(["a", "b"], dtype=object)
    path = written(tmp_path, dataproto_pickle((torch_saved(None), {"uid": uids}, {"k": 1})))
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
    batch = read_gen_batch(written(tmp_path, dataproto_pickle((torch_saved(td), {}, {}))))
    assert batch.equals(Batch(tensors)), batch
    empty = dataproto_pickle((torch_saved(fake_tensordict({}, [4])), {}, {}))
    assert len(read_gen_batch(written(tmp_path, empty)).batch) == 0


# -- a tampered torch.save archive ----------------------------------------------------------


def rezipped(raw: bytes, storage: bytes | None = None, compression: int = zipfile.ZIP_STORED) -> bytes:
    """The ``torch.save`` archive ``raw`` rewritten: its one storage record replaced, or compressed."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as source, zipfile.ZipFile(out, "w", compression) as target:
        for info in source.infolist():
            data = source.read(info)
            if storage is not None and info.filename.endswith("/data/0"):
                data = storage
            target.writestr(info.filename, data)
    return out.getvalue()


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda raw: rezipped(raw, storage=b"\0" * 8), r"storage record .*/data/0 has 8 bytes, expected 96"),
        (lambda raw: rezipped(raw, compression=zipfile.ZIP_DEFLATED), "is compressed, which torch.save never does"),
        (lambda raw: b"not a zip archive", "is not a torch zip archive"),
    ],
    ids=["short-storage", "compressed", "not-a-zip"],
)
def test_a_tampered_batch_archive_is_refused(tmp_path, fake_tensordict, tamper, message):
    raw = torch_saved(fake_tensordict({"f32": torch.zeros(4, 6)}, [4]))
    path = written(tmp_path, dataproto_pickle((tamper(raw), {}, {})))
    with pytest.raises(VerlDumpError, match=message):
        read_gen_batch(path)
