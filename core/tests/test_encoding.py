import json

import numpy as np
import pytest
import torch
from skip_core import Batch
from skip_core.encoding import EncodingError, decode, encode, fingerprint


@pytest.mark.parametrize(
    "value",
    [
        {"nested": {"list": [1, 2.5, None, True], "text": "ü"}},
        (1, "two", (3,)),
        {1: "int key", (2, 3): "tuple key"},
        {"__skip__": "looks like a tag"},
        np.float32(0.25),
        np.int64(-3),
        np.float64(0.1),  # a float subclass: must come back as np.float64, not float
        np.str_("text"),
        np.array([[1, 2], [3, 4]], dtype=np.uint8),
        np.array(["a", "bc"]),
        np.array([{"a": 1}, [1, 2], None], dtype=object),
        b"\x00\xffbytes",
        float("inf"),
    ],
)
def test_values_survive_a_json_round_trip(value):
    back = decode(json.loads(json.dumps(encode(value, "v"))))
    assert type(back) is type(value)
    if isinstance(value, np.ndarray):
        assert back.dtype == value.dtype and back.shape == value.shape
        assert all(a == b for a, b in zip(back.ravel(), value.ravel(), strict=True))
    else:
        assert back == value


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (object(), "v: cannot store a value of type object"),
        ({"a": [1, {2}]}, "v['a'][1]: cannot store a value of type set"),
        (torch.zeros(2), "v: cannot store a value of type Tensor"),
        (np.array(["2020-01-01"], dtype="datetime64[D]"), "v: cannot store numpy dtype"),
    ],
)
def test_unstorable_values_name_where_they_are(value, where):
    with pytest.raises(EncodingError, match=where.replace("[", r"\[").replace("]", r"\]")):
        encode(value, "v")


@pytest.mark.parametrize(
    "forged",
    [
        {"__skip__": "pickle", "data": "gASV"},
        {"__skip__": "ndarray", "dtype": "O", "shape": [1], "items": [{"__skip__": "callable"}]},
        {"__skip__": "scalar", "dtype": "M8[D]", "value": 0},
    ],
)
def test_decoding_refuses_forms_it_did_not_write(forged):
    with pytest.raises(ValueError):
        decode(forged)


def prompts(seed: int = 0, uid: str = "u") -> Batch:
    ids = torch.arange(12).view(3, 4) + seed
    return Batch.from_dict({"input_ids": ids}, {"raw_prompt": ["a", "b", "c"], "uid": [uid] * 3}, {"step": seed})


def test_fingerprint_tracks_content_not_identity_or_meta():
    assert fingerprint(prompts()) == fingerprint(prompts(uid="other"))
    base = prompts()
    base.meta_info["step"] = 99
    assert fingerprint(base) == fingerprint(prompts())
    assert fingerprint(prompts(seed=1)) != fingerprint(prompts())
    changed = prompts()
    changed.non_tensor_batch["raw_prompt"][0] = "z"
    assert fingerprint(changed) != fingerprint(prompts())
    assert fingerprint({"not": "a batch"}) is None


def test_inputs_that_cannot_be_stored_have_no_fingerprint_and_still_replay(tmp_path):
    """Images in verl's ``multi_modal_data`` are such inputs: the call must not fail over the check."""
    from skip_core import SkipManager
    from skiptests import Generator, run_config

    unstorable = prompts()
    unstorable.non_tensor_batch["image"] = np.array([object()] * 3, dtype=object)
    assert fingerprint(unstorable) is None

    generator = Generator()
    SkipManager.init(run_config(tmp_path, steps=[1]))
    SkipManager.set_step(1)
    first = generator.generate_sequences(unstorable)
    again = generator.generate_sequences(unstorable)
    assert generator.calls == 1 and again.equals(first)


def test_fingerprint_covers_dtype_and_shape():
    a = Batch.from_dict({"x": torch.zeros(2, 4, dtype=torch.int32)})
    b = Batch.from_dict({"x": torch.zeros(2, 2, dtype=torch.int64)})
    assert fingerprint(a) != fingerprint(b)


def _jagged(*lengths: int) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged)


def test_jagged_tensors_are_stored_as_values_and_offsets_and_come_back_ragged(tmp_path):
    from safetensors import safe_open
    from skip_core.encoding import TENSORS, read, write

    batch = Batch({"responses": _jagged(3, 1, 4), "reward": torch.tensor([0.5, 1.0, 0.0])})
    write(batch, tmp_path)
    back = read(tmp_path)

    with safe_open(str(tmp_path / TENSORS), "pt") as stored:
        assert sorted(stored.keys()) == ["responses\x1fjagged_offsets", "responses\x1fjagged_values", "reward"]
    assert back.batch["responses"].is_nested
    assert [row.tolist() for row in back.batch["responses"].unbind()] == [[0, 1, 2], [0], [0, 1, 2, 3]]
    other = Batch({"responses": _jagged(3, 2, 3), "reward": batch.batch["reward"]})  # same values, other rows
    assert fingerprint(back) == fingerprint(batch) != fingerprint(other)


@pytest.mark.parametrize(
    "offsets",
    [torch.tensor([0, 2, 1, 8]), torch.tensor([0, 3, 4, 9]), torch.tensor([1, 3, 4, 8]), torch.tensor([0.0, 8.0])],
)
def test_offsets_that_do_not_split_the_values_are_refused(tmp_path, offsets):
    from safetensors.torch import save_file
    from skip_core.encoding import DATA, TENSORS, read

    save_file({"r\x1fjagged_values": torch.arange(8), "r\x1fjagged_offsets": offsets}, str(tmp_path / TENSORS))
    (tmp_path / DATA).write_text(json.dumps({"non_tensor_batch": {}, "meta_info": {}}))

    with pytest.raises(ValueError, match="batch\\['r'\\]"):
        read(tmp_path)


def test_a_nested_tensor_with_holes_is_refused_naming_it():
    from skip_core.encoding import storable

    values, offsets = torch.arange(6), torch.tensor([0, 3, 6])
    holes = torch.nested.nested_tensor_from_jagged(values, offsets, lengths=torch.tensor([2, 3]))

    assert fingerprint(Batch({"r": holes})) is None  # inputs that cannot be stored go unchecked
    with pytest.raises(EncodingError, match="batch\\['r'\\]"):
        storable({"r": holes})
