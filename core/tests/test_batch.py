import numpy as np
import pytest
import torch
from skip_core import Batch


def batch(n: int = 4) -> Batch:
    return Batch.from_dict(
        {"input_ids": torch.arange(n * 3).view(n, 3), "mask": torch.ones(n, 3, dtype=torch.bool)},
        {"raw_prompt": [f"p{i}" for i in range(n)], "tools_kwargs": [{"calc": {"x": i}} for i in range(n)]},
        {"temperature": 1.0},
    )


def test_from_dict_makes_object_arrays_and_keeps_nested_values():
    b = batch()
    assert len(b) == 4
    assert b.non_tensor_batch["tools_kwargs"].dtype == object
    assert b.non_tensor_batch["tools_kwargs"][2] == {"calc": {"x": 2}}


def test_lists_of_lists_stay_one_object_per_sample():
    b = Batch.from_dict(non_tensors={"turns": [[1, 2], [3, 4]]})
    assert b.non_tensor_batch["turns"].shape == (2,)
    assert b.non_tensor_batch["turns"][1] == [3, 4]


def test_inconsistent_lengths_are_rejected_with_the_keys():
    with pytest.raises(ValueError, match=r"batch\['a'\]: 2.*non_tensor_batch\['b'\]: 3"):
        Batch.from_dict({"a": torch.zeros(2)}, {"b": ["x", "y", "z"]})


def test_wrong_types_are_rejected():
    with pytest.raises(TypeError, match="expected a torch tensor"):
        Batch({"a": [1, 2]})
    with pytest.raises(TypeError, match="expected a numpy array"):
        Batch(non_tensor_batch={"a": [1, 2]})


def test_pop_removes_and_returns_the_named_keys():
    b = batch()
    popped = b.pop(["input_ids"], ["raw_prompt"], ["temperature"])
    assert list(popped.batch) == ["input_ids"] and list(popped.non_tensor_batch) == ["raw_prompt"]
    assert list(b.batch) == ["mask"] and list(b.non_tensor_batch) == ["tools_kwargs"] and b.meta_info == {}


def test_select_missing_key_names_it():
    with pytest.raises(KeyError, match="'nope'"):
        batch().select(["nope"])


def test_union_merges_and_refuses_conflicts():
    b = batch()
    extra = Batch.from_dict({"responses": torch.zeros(4, 2)}, {"uid": list("abcd")})
    b.union(extra)
    assert set(b.batch) == {"input_ids", "mask", "responses"} and "uid" in b.non_tensor_batch
    b.union(batch())  # identical keys with identical values are fine
    with pytest.raises(ValueError, match=r"batch\['input_ids'\] differs"):
        b.union(Batch.from_dict({"input_ids": torch.zeros(4, 3, dtype=torch.long)}))


def test_repeat_interleaves_for_grpo_groups():
    b = batch(2).repeat(3, interleave=True)
    assert b.batch["input_ids"][:, 0].tolist() == [0, 0, 0, 3, 3, 3]
    assert list(b.non_tensor_batch["raw_prompt"]) == ["p0"] * 3 + ["p1"] * 3
    tiled = batch(2).repeat(2, interleave=False)
    assert list(tiled.non_tensor_batch["raw_prompt"]) == ["p0", "p1", "p0", "p1"]


def test_chunk_and_concat_round_trip():
    b = batch(6)
    parts = b.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert Batch.concat(parts).equals(b)
    with pytest.raises(ValueError, match="cannot split 6 samples into 4"):
        b.chunk(4)


def test_indexing_by_slice_list_mask_and_int():
    b = batch(4)
    assert b[1:3].batch["input_ids"][:, 0].tolist() == [3, 6]
    assert list(b[[3, 0]].non_tensor_batch["raw_prompt"]) == ["p3", "p0"]
    assert len(b[np.array([True, False, True, False])]) == 2
    assert list(b[-1].non_tensor_batch["raw_prompt"]) == ["p3"]


def test_equals_compares_dtypes_and_nested_values():
    assert batch().equals(batch())
    other = batch()
    other.non_tensor_batch["tools_kwargs"][0] = {"calc": {"x": 99}}
    assert not batch().equals(other)
    floats = batch()
    floats.batch["input_ids"] = floats.batch["input_ids"].float()
    assert not batch().equals(floats)
