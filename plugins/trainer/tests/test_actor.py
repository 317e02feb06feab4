"""The policy worker in-process: log-probs on padded batches, the PPO step, micro-batching."""

import math

import pytest
import torch
from batches import ROWS, padded_batch
from skip_core.batch import Batch
from skip_plugin_trainer.algorithms.aggregation import LOSS_AGG_MODES
from skip_plugin_trainer.config.algorithm import ActorConfig, Optim
from skip_plugin_trainer.train.policy import Policy


def policy(model_dir, **settings) -> Policy:
    config = ActorConfig(**{"ppo_mini_batch_size": 3, "ppo_micro_batch_size": 3, "optim": Optim(lr=1e-3), **settings})
    return Policy(str(model_dir), config, samples_per_prompt=1, temperature=0.7, use_reference=config.use_kl_loss)


def unpadded_log_probs(model, prompt, response, temperature) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_log_probs_on_a_padded_batch_match_each_row_alone(tiny_model_dir):
    worker = policy(tiny_model_dir)
    out = worker.compute_log_prob(padded_batch(ROWS))
    for i, (prompt, response) in enumerate(ROWS):
        with torch.no_grad():
            alone = unpadded_log_probs(worker.model, prompt, response, 0.7)
        assert torch.allclose(out.batch["old_log_probs"][i, : len(response)], alone, atol=1e-5)
        assert (out.batch["entropys"][i, : len(response)] > 0).all()


def training_batch(worker: Policy, advantages: list[float]) -> Batch:
    batch = padded_batch(ROWS)
    batch.batch["old_log_probs"] = worker.compute_log_prob(batch).batch["old_log_probs"]
    batch.batch["advantages"] = torch.tensor(advantages)[:, None] * batch.batch["response_mask"]
    return batch


def test_an_update_raises_the_likelihood_of_positive_advantage_samples(tiny_model_dir):
    worker = policy(tiny_model_dir)
    batch = training_batch(worker, [1.0, -1.0, 0.0])
    before = batch.batch["old_log_probs"]
    metrics = worker.update(batch)
    after = worker.compute_log_prob(batch).batch["old_log_probs"]
    mask = batch.batch["response_mask"].bool()
    assert (after[0] - before[0])[mask[0]].sum() > 0
    assert (after[1] - before[1])[mask[1]].sum() < 0
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/pg_clipfrac"] == 0  # ratio 1 on the first step
    assert metrics["actor/pg_loss"] == pytest.approx(-(4 * 1.0 - 2 * 1.0) / 12, abs=1e-6)  # token-mean of -A


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_accumulate_to_the_full_batch_gradient(tiny_model_dir, mode):
    """Each micro-batch's loss is its part of the whole mini-batch's (divided by the mini-batch's
    tokens or rows, not its own), so in every mode three micro-batches of one row of ragged
    length accumulate the gradient of one micro-batch of three (the gradients stay on the
    parameters after the optimizer step), and the loss metric is the whole's."""
    advantages = [1.0, -0.5, 0.25]
    whole = policy(tiny_model_dir, loss_agg_mode=mode)
    split = policy(tiny_model_dir, loss_agg_mode=mode, ppo_micro_batch_size=1)
    whole_metrics = whole.update(training_batch(whole, advantages))
    split_metrics = split.update(training_batch(split, advantages))
    assert whole_metrics["actor/grad_norm"] == pytest.approx(split_metrics["actor/grad_norm"], rel=1e-5)
    assert whole_metrics["actor/grad_norm"] > 0
    assert whole_metrics["actor/pg_loss"] == pytest.approx(split_metrics["actor/pg_loss"], rel=1e-5)
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)


def test_the_reference_model_stays_at_the_initial_weights(tiny_model_dir):
    worker = policy(tiny_model_dir, use_kl_loss=True)
    batch = training_batch(worker, [1.0, -1.0, 0.5])
    start = worker.compute_ref_log_prob(batch).batch["ref_log_prob"]
    batch.batch["ref_log_prob"] = start
    metrics = worker.update(batch)
    assert metrics["actor/kl_loss"] == pytest.approx(0, abs=1e-7)  # one optimizer step: policy == reference
    assert torch.equal(worker.compute_ref_log_prob(batch).batch["ref_log_prob"], start)
    assert not torch.equal(worker.compute_log_prob(batch).batch["old_log_probs"], start)


def test_a_step_whose_gradient_is_not_finite_is_skipped_and_said(tiny_model_dir):
    worker = policy(tiny_model_dir, grad_clip=None)
    batch = training_batch(worker, [float("nan"), 1.0, -1.0])
    before = {name: tensor.clone() for name, tensor in worker.model.state_dict().items()}
    metrics = worker.update(batch)
    assert metrics["actor/skipped_steps"] == 1.0 and math.isnan(metrics["actor/grad_norm"])
    assert all(torch.equal(tensor, before[name]) for name, tensor in worker.model.state_dict().items())
    assert "actor/skipped_steps" not in worker.update(training_batch(worker, [1.0, -0.5, 0.25]))
