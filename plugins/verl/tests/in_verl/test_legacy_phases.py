"""``skip.old_log_prob``, ``skip.ref_log_prob`` and ``skip.values`` on verl 0.9.1's legacy trainer
(``trainer.use_v1=false``): verl's real ``RayPPOTrainer`` phase methods, with their padding
conversions, called as its ``fit()`` calls them; only the worker groups are scripted (random
outputs per call, so a replay that called them would differ). The legacy ``fit()`` itself needs
GPUs (NCCL workers) and is not run."""

from __future__ import annotations

import numpy as np
import pytest
import skip_core
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils.skip import SkipManager

PROMPT, RESPONSE = 4, 3


def config(dump_dir, **role_settings):
    settings = {"enable": True, "dump_dir": str(dump_dir), "steps": [1, 2], **role_settings}
    return OmegaConf.create(
        {
            "trainer": {"experiment_name": "exp", "project_name": "proj"},
            "data": {"train_batch_size": 2, "max_prompt_length": PROMPT, "max_response_length": RESPONSE},
            "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"calculate_sum_pi_squared": False}},
            "skip": {role: dict(settings) for role in ("old_log_prob", "ref_log_prob", "values")},
        }
    )


def step_batch(seed: int) -> DataProto:
    """A left/right padded step batch as the legacy trainer holds it before its phases."""
    generator = torch.Generator().manual_seed(seed)
    rows = 4
    prompts = torch.randint(1, 100, (rows, PROMPT), generator=generator)
    responses = torch.randint(1, 100, (rows, RESPONSE), generator=generator)
    attention = torch.ones(rows, PROMPT + RESPONSE, dtype=torch.int64)
    attention[0, 0] = 0  # a left-padded prompt
    attention[1, -1] = 0  # a right-padded response
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "response_mask": attention[:, PROMPT:].clone(),
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        },
        non_tensors={"uid": np.array([f"u{seed}-{i // 2}" for i in range(rows)], dtype=object)},
    )


class Workers:
    """verl's actor, reference and critic worker groups: per-token outputs in their no-padding layout."""

    def __init__(self) -> None:
        self.calls = 0

    def _tokens(self, batch: TensorDict) -> torch.Tensor:
        self.calls += 1
        ids = batch["input_ids"]
        return torch.nested.nested_tensor_from_jagged(-torch.rand(len(ids.values())), ids.offsets())

    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        from verl.utils import tensordict_utils as tu

        out = TensorDict({"log_probs": self._tokens(batch), "entropy": self._tokens(batch)}, batch_size=[])
        tu.assign_non_tensor_data(out, "metrics", {"mfu": 0.25})
        return out

    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"log_probs": self._tokens(batch)}, batch_size=[])

    def infer_batch(self, batch: TensorDict):
        values = TensorDict({"values": self._tokens(batch)}, batch_size=[])
        return type("Future", (), {"get": lambda _: values})()


def trainer(workers: Workers) -> RayPPOTrainer:
    legacy = object.__new__(RayPPOTrainer)
    legacy.config = OmegaConf.create({"actor_rollout_ref": {"actor": {"calculate_sum_pi_squared": False}}})
    legacy.ref_in_actor = False
    legacy.actor_rollout_wg = legacy.ref_policy_wg = legacy.critic_wg = workers
    return legacy


def phases(legacy: RayPPOTrainer, batch: DataProto) -> dict[str, torch.Tensor]:
    """The three phases, as ``RayPPOTrainer.fit`` calls and uses them."""
    old, mfu = legacy._compute_old_log_prob(batch)
    entropy = old.batch.pop("entropys")  # what fit() does with it, right away
    assert mfu == 0.25
    ref = legacy._compute_ref_log_prob(batch)
    values = legacy._compute_values(batch)
    return {
        "old": old.batch["old_log_probs"],
        "entropy": entropy,
        "ref": ref.batch["ref_log_prob"],
        "values": values.batch["values"],
    }


@pytest.fixture(autouse=True)
def _fresh():
    skip_core.SkipManager.reset()
    yield
    skip_core.SkipManager.reset()


def run(dump_dir, batches, workers=None, **settings):
    workers = workers or Workers()
    SkipManager.init(config(dump_dir, **settings))
    legacy, outputs = trainer(workers), []
    for step, batch in enumerate(batches, start=1):
        SkipManager.set_step(step)
        outputs.append(phases(legacy, batch))
    skip_core.SkipManager.flush()
    return outputs, workers.calls


def test_a_second_run_replays_every_phase_without_a_worker_call(tmp_path):
    first, first_calls = run(tmp_path, [step_batch(1), step_batch(2)])
    second, second_calls = run(tmp_path, [step_batch(1), step_batch(2)])

    assert first_calls == 2 * 4 and second_calls == 0
    for a, b in zip(first, second, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for role in ("old_log_prob", "ref_log_prob", "values"):
        assert sorted(p.name for p in (tmp_path / "exp_proj" / role).glob("*/[0-9]*")) == ["1", "2"]


def test_other_inputs_are_a_mismatch(tmp_path):
    run(tmp_path, [step_batch(1)])

    with pytest.raises(skip_core.caching.PromptMismatchError, match=r"skip\.old_log_prob step 1"):
        run(tmp_path, [step_batch(7)], on_prompt_mismatch="error")
    skip_core.SkipManager.reset()
    _, calls = run(tmp_path, [step_batch(7)], on_prompt_mismatch="regenerate")
    assert calls == 4


def test_a_subclass_that_overrides_a_phase_runs_it_untouched(tmp_path):
    class Overriding(RayPPOTrainer):  # as the fully-async trainer does, on its own step count
        def _compute_values(self, batch):
            return super()._compute_values(batch)

    run(tmp_path, [step_batch(1)])
    workers = Workers()
    SkipManager.init(config(tmp_path))
    SkipManager.set_step(1)
    legacy = trainer(workers)
    legacy.__class__ = Overriding
    legacy._compute_values(step_batch(1))

    assert workers.calls == 1
