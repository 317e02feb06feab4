"""LoRA on the policy (verl's ``model.lora_rank``): only the adapters train, the engines get the
merged weights, the reference is the base model, and a checkpoint resumes the same adapters."""

import pytest
import torch
from batches import ROWS, padded_batch
from skip_core.config import ConfigError
from skip_plugin_trainer.config.algorithm import ActorConfig, Optim
from skip_plugin_trainer.config.sections import ModelConfig
from skip_plugin_trainer.train.policy import Policy
from training import metrics, train
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.integration  # LoRA runs


def lora_policy(model_dir, rank: int = 4) -> Policy:
    config = ActorConfig(ppo_mini_batch_size=3, ppo_micro_batch_size=3, optim=Optim(lr=1e-2), use_kl_loss=True)
    lora = ModelConfig(path=str(model_dir), lora_rank=rank, lora_alpha=8)
    return Policy(str(model_dir), config, samples_per_prompt=1, use_reference=True, model_config=lora)


def trained(worker: Policy, updates: int = 2):
    batch = padded_batch(ROWS)
    batch.batch["old_log_probs"] = worker.compute_log_prob(batch).batch["old_log_probs"]
    batch.batch["ref_log_prob"] = worker.compute_ref_log_prob(batch).batch["ref_log_prob"]
    batch.batch["advantages"] = torch.tensor([1.0, -1.0, 0.0])[:, None] * batch.batch["response_mask"]
    for _ in range(updates):
        worker.update(batch)
    return batch


def published(worker: Policy) -> dict[str, torch.Tensor]:
    worker.publish_weights(512, keep=True)
    return dict(worker._published.tensors)


def test_only_the_adapters_train_and_the_engines_get_the_merged_weights(tiny_model_dir):
    worker = lora_policy(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainable = {name for name, p in worker.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert published(worker).keys() <= base.state_dict().keys()
    assert all(torch.equal(t, base.state_dict()[name]) for name, t in published(worker).items())  # B starts at 0

    batch = trained(worker)
    weights = published(worker)
    changed = {name for name, t in weights.items() if not torch.equal(t, base.state_dict()[name])}
    assert changed and all(name.endswith("_proj.weight") for name in changed)  # the linear layers only
    frozen = {n: t for n, t in worker.model.get_base_model().state_dict().items() if ".base_layer." in n}
    assert all(torch.equal(t, base.state_dict()[n.replace(".base_layer.", ".")]) for n, t in frozen.items())

    # The merged weights are the model the trainer computes with: loaded into a plain model, same log-probs.
    base.load_state_dict(weights, strict=False)
    plain = Policy(str(tiny_model_dir), worker.config, samples_per_prompt=1)
    plain.model.load_state_dict(base.state_dict())
    assert torch.allclose(
        plain.compute_log_prob(batch).batch["old_log_probs"],
        worker.compute_log_prob(batch).batch["old_log_probs"],
        atol=1e-5,
    )
    # The reference is the base model, whatever the adapters learned.
    assert torch.equal(worker.compute_ref_log_prob(batch).batch["ref_log_prob"], batch.batch["ref_log_prob"])


def test_a_checkpoint_resumes_the_same_adapters(tiny_model_dir, tmp_path):
    worker = lora_policy(tiny_model_dir)
    batch = trained(worker)
    saved = worker.save_shards(str(tmp_path))
    resumed = lora_policy(tiny_model_dir)
    resumed.load_shards(str(tmp_path), saved, updates=2)
    assert all(torch.equal(a, b) for a, b in zip(published(worker).values(), published(resumed).values(), strict=True))
    worker.update(batch)
    resumed.update(batch)
    assert all(torch.equal(a, b) for a, b in zip(published(worker).values(), published(resumed).values(), strict=True))


def test_a_lora_run_trains_syncs_the_engines_and_resumes_only_as_lora(ray_session, task_dir, tmp_path):
    # an entropy bonus moves the policy whatever the rewards of the tiny model's samples
    lora = ("model.lora_rank=4", "model.lora_alpha=8", "actor.use_kl_loss=true", "actor.entropy_coeff=0.1")
    lora = (*lora, "actor.optim.lr=1e-2", "trainer.save_freq=1")
    train(task_dir, tmp_path, *lora, "trainer.total_training_steps=2")
    rows = [row for row in metrics(tmp_path / "run") if "actor/pg_loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    # step 2 generated with the weights step 1 synced: the engine's log-probs are the trainer's
    assert rows[1]["training/rollout_probs_diff_max"] < 1e-3
    assert rows[1]["actor/kl_loss"] > 0.01  # the adapters moved the policy well off the base model
    with pytest.raises(ConfigError, match=r"model\.lora_rank \(4 there, None here\)"):
        train(task_dir, tmp_path, "trainer.total_training_steps=3")
