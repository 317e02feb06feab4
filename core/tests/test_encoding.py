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
