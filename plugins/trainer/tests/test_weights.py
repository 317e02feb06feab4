"""Weights in buckets: the plan, the packing, the policy that publishes them and the agent loop that
loads them into a real hf engine bucket by bucket."""

import asyncio

import numpy as np
import pytest
import torch
from scripted_model import make_loop
from skip_core.backend import create_backend
from skip_core.sections import Sections
from skip_plugin_hf.options import HFOptions
from skip_plugin_trainer.config.algorithm import ActorConfig, Optim
from skip_plugin_trainer.rollout.weights import MEGABYTE, Bucket, TensorSpec, pack, plan, unpack
from skip_plugin_trainer.train.policy import Policy
from transformers import AutoTokenizer


def test_plan_fills_buckets_in_order_and_gives_a_tensor_larger_than_a_bucket_its_own():
    sizes = [("a", 3 * MEGABYTE), ("b", 3 * MEGABYTE), ("c", 5 * MEGABYTE), ("d", MEGABYTE), ("e", MEGABYTE)]
    assert plan(sizes, 4) == [["a"], ["b"], ["c"], ["d", "e"]]
    assert plan(sizes, 7) == [["a", "b"], ["c", "d", "e"]]
    assert plan(sizes, 100) == [["a", "b", "c", "d", "e"]]
    assert plan([], 4) == []


def test_pack_and_unpack_keep_every_tensor_its_dtype_shape_and_values():
    tensors = {
        "w": torch.randn(3, 5).t(),  # not contiguous
        "half": torch.randn(7, dtype=torch.bfloat16),
        "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "scalar": torch.tensor(2.5),
    }
    bucket = pack(tensors)
    assert bucket.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    back = unpack(bucket)
    assert list(back) == list(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name], tensor)


def test_pack_and_unpack_copy_nothing_and_unpack_refuses_an_unknown_dtype():
    weight = torch.ones(4)
    (data,) = pack({"w": weight}).data
    assert data.ctypes.data == weight.data_ptr()
    data.flags.writeable = False  # as the object store hands it out
    back = unpack(Bucket((TensorSpec("w", "float32", (4,)),), (data,)))
    assert back["w"].data_ptr() == data.ctypes.data
    with pytest.raises(ValueError, match="unknown dtype 'Tensor'"):
        unpack(Bucket((TensorSpec("w", "Tensor", (4,)),), (np.zeros(16, dtype=np.uint8),)))


def _policy(model_dir) -> Policy:
    config = ActorConfig(ppo_mini_batch_size=1, ppo_micro_batch_size=1, optim=Optim(lr=1e-3))
    return Policy(str(model_dir), config, samples_per_prompt=1)


def test_published_weights_are_every_distinct_tensor_once_and_kept_ones_do_not_follow_training(tiny_model_dir):
    policy = _policy(tiny_model_dir)
    count = len(policy.publish_weights(0.25, keep=True))
    buckets = [policy.weight_bucket(index) for index in range(count)]
    assert count > 4 and all(b.nbytes <= 0.25 * MEGABYTE for b in buckets if len(b.specs) > 1)
    sent = {name: tensor for bucket in buckets for name, tensor in unpack(bucket).items()}
    model = policy.model.state_dict()
    tied = model.keys() - sent.keys()  # names that are another's storage (a tied LM head)
    assert all(any(model[name].data_ptr() == model[other].data_ptr() for other in sent) for name in tied)
    assert all(torch.equal(tensor, model[name]) for name, tensor in sent.items())

    with torch.no_grad():
        next(policy.model.parameters()).add_(1.0)  # training goes on while a kept version is sent
    first = next(iter(sent))
    assert torch.equal(unpack(policy.weight_bucket(0))[first], sent[first])
    policy.publish_weights(0.25, keep=False)
    assert torch.equal(unpack(policy.weight_bucket(0))[first], model[first])  # live: the new values


def test_the_agent_loop_loads_buckets_into_the_engine_and_errors_leave_it_usable(tiny_model_dir):
    policy = _policy(tiny_model_dir)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            parameter.mul_(1.5)
    count = len(policy.publish_weights(0.25, keep=False))
    backend = create_backend("hf", Sections(HFOptions(device="cpu")), tiny_model_dir)
    loop = make_loop(AutoTokenizer.from_pretrained(tiny_model_dir), backend)
    try:
        with pytest.raises(RuntimeError, match="bucket 2 of 5 arrived without bucket 0"):
            loop.load_weights_bucket({}, 2, 5, 1, False)
        for index in range(count):
            loop.load_weights_bucket(unpack(policy.weight_bucket(index)), index, count, 3, True)
        assert loop.weights.version == 3 and loop.weights.ready.is_set()
        engine = backend.model.state_dict()
        assert all(torch.equal(engine[name], tensor) for name, tensor in policy.model.state_dict().items())

        with pytest.raises(KeyError, match="no weights named nope"):
            loop.load_weights_bucket({"nope": torch.zeros(1)}, 0, 2, 4, True)
        assert loop.weights.version == 3 and loop.weights.ready.is_set()  # resumed, the old version kept
    finally:
        loop.shutdown()


def test_a_backend_that_stops_reading_buckets_is_an_error_not_a_hang(tiny_model_dir):
    class ReadsOne:
        async def update_weights(self, buckets):
            async for _ in buckets:
                return

    from skip_plugin_trainer.rollout.weights import EngineWeights

    weights = EngineWeights(ReadsOne())

    async def sync():
        await weights.load_bucket({"a": torch.zeros(1)}, 0, 3, 1, False)
        await weights.load_bucket({"b": torch.zeros(1)}, 1, 3, 1, False)

    with pytest.raises(RuntimeError, match="returned before it read every bucket"):
        asyncio.run(sync())
    assert weights.version == 0
