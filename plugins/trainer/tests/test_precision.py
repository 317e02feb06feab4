"""What makes a large model fit, on the policy in-process: compute in bfloat16 over float32 master
state, gradient checkpointing, token-budget micro-batches and chunked log-probs, each against the
plain float32 path it must match (or stay within a stated tolerance of)."""

import json
import random
import shutil
from unittest import mock

import pytest
import torch
from batches import PROMPT, RESPONSE, ROWS, padded_batch
from skip_core.batch import Batch
from skip_plugin_trainer.config.algorithm import ActorConfig, FsdpConfig, Optim
from skip_plugin_trainer.config.sections import ModelConfig
from skip_plugin_trainer.train.logits import token_log_probs
from skip_plugin_trainer.train.micro_batches import equalise, pack, spans, split
from skip_plugin_trainer.train.policy import Policy

# bfloat16 keeps 8 bits of mantissa: a log-prob near -6 is off by up to ~0.03 per token on this model.
BF16_LOG_PROB_ATOL = 0.1


def policy(model_dir, checkpointing=True, dtype=None, rows=3, colocated=False, overrides=None, **settings) -> Policy:
    """A policy whose mini-batch is ``rows`` samples."""
    settings = {"fsdp_config": FsdpConfig(dtype=dtype), **settings}
    config = ActorConfig(
        **{"ppo_mini_batch_size": rows, "ppo_micro_batch_size": rows, "optim": Optim(lr=1e-3), **settings}
    )
    return Policy(
        str(model_dir),
        config,
        samples_per_prompt=1,
        temperature=0.7,
        use_reference=config.use_kl_loss,
        model_config=ModelConfig(enable_gradient_checkpointing=checkpointing, override_config=overrides or {}),
        colocated=colocated,
    )


def ragged_rows(count: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)

    def tokens(most: int) -> list[int]:
        return [rng.randrange(5, 500) for _ in range(rng.randint(1, most))]

    return [(tokens(PROMPT), tokens(RESPONSE)) for _ in range(count)]


def training_batch(worker: Policy, rows) -> Batch:
    batch = padded_batch(rows)
    batch.batch["old_log_probs"] = worker.compute_log_prob(batch).batch["old_log_probs"]
    advantages = torch.linspace(-1, 1, len(rows))
    batch.batch["advantages"] = advantages[:, None] * batch.batch["response_mask"]
    return batch


def test_chunked_log_probs_and_entropy_equal_the_whole_with_and_without_a_gradient():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5))
    whole = token_log_probs(logits, labels, temperature=0.7, entropy=True)
    (expected,) = torch.autograd.grad((whole[0] + whole[1]).sum(), logits)
    for chunk, recompute in [(4, False), (4, True), (1, True), (100, False)]:
        part = token_log_probs(logits, labels, temperature=0.7, entropy=True, chunk=chunk, recompute=recompute)
        assert torch.equal(part[0], whole[0]) and torch.equal(part[1], whole[1])
        (gradient,) = torch.autograd.grad((part[0] + part[1]).sum(), logits)
        assert torch.equal(gradient, expected)
    assert whole[0].dtype == torch.float32  # the float32 copy is per chunk, not of the compute dtype


def test_the_sum_of_squared_probabilities_is_the_softmaxs_whole_or_chunked():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 4, 7) * 5, torch.randint(0, 7, (2, 4))
    expected = (torch.softmax(logits / 0.7, -1) ** 2).sum(-1)
    for chunk in (None, 3):
        outputs = token_log_probs(logits, labels, temperature=0.7, entropy=False, chunk=chunk, sum_pi_squared=True)
        assert outputs[1] is None
        torch.testing.assert_close(outputs[2], expected)


def test_override_config_changes_the_model_the_policy_and_its_reference_train(tiny_model_dir):
    batch = padded_batch(ROWS)
    plain = policy(tiny_model_dir, use_kl_loss=True)
    overridden = policy(tiny_model_dir, use_kl_loss=True, overrides={"rms_norm_eps": 0.5})
    assert overridden.model.config.rms_norm_eps == 0.5 != plain.model.config.rms_norm_eps
    assert overridden.reference.config.rms_norm_eps == 0.5
    assert not torch.equal(
        overridden.compute_log_prob(batch).batch["old_log_probs"], plain.compute_log_prob(batch).batch["old_log_probs"]
    )


def test_the_old_log_prob_pass_gives_the_squares_when_asked(tiny_model_dir):
    batch = padded_batch(ROWS)
    plain = policy(tiny_model_dir).compute_log_prob(batch)
    asked = policy(tiny_model_dir, calculate_sum_pi_squared=True).compute_log_prob(batch)
    assert "sum_pi_squared" not in plain.batch
    assert torch.equal(asked.batch["old_log_probs"], plain.batch["old_log_probs"])
    mask = batch.batch["response_mask"].bool()
    squares, picked = asked.batch["sum_pi_squared"][mask], asked.batch["old_log_probs"].exp()[mask]
    assert (squares <= 1 + 1e-6).all() and (squares >= picked**2 - 1e-6).all()  # the label's own square is one term


def test_train_mode_with_dropout_zeroed_changes_no_log_prob(tiny_model_dir, tmp_path):
    """A model whose config asks for attention dropout trains in train mode (checkpointing needs
    it) with every dropout at 0: its log-probs are those of eval mode, call after call."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    worker = policy(model_dir)
    batch = padded_batch(ROWS)
    assert worker.model.training
    trained_mode = worker.compute_log_prob(batch).batch["old_log_probs"]
    worker.model.eval()
    assert torch.equal(worker.compute_log_prob(batch).batch["old_log_probs"], trained_mode)


def test_gradient_checkpointing_recomputes_each_layer_and_changes_no_gradient(tiny_model_dir):
    runs = {}
    for checkpointing in (False, True):
        worker = policy(tiny_model_dir, checkpointing=checkpointing)
        batch = training_batch(worker, ROWS)
        mlp = worker.model.model.layers[0].mlp
        with mock.patch.object(mlp, "forward", wraps=mlp.forward) as forward:  # a recomputation fires no hooks
            worker.update(batch)
        runs[checkpointing] = (forward.call_count, [p.grad.clone() for p in worker.model.parameters()])
    assert runs[False][0] == 1 and runs[True][0] == 2  # the update's forward, and its recomputation
    for plain, recomputed in zip(runs[False][1], runs[True][1], strict=True):
        assert torch.equal(plain, recomputed)


def test_bfloat16_compute_keeps_float32_weights_gradients_and_adam_state_within_tolerance(tiny_model_dir):
    full, mixed = policy(tiny_model_dir), policy(tiny_model_dir, dtype="bfloat16")
    batch = padded_batch(ROWS)
    expected = full.compute_log_prob(batch).batch["old_log_probs"]
    got = mixed.compute_log_prob(batch).batch["old_log_probs"]
    mask = batch.batch["response_mask"].bool()
    assert got.dtype == torch.float32 and not torch.equal(got[mask], expected[mask])  # it computed in bf16
    assert torch.allclose(got[mask], expected[mask], atol=BF16_LOG_PROB_ATOL)
    metrics = {name: worker.update(training_batch(worker, ROWS)) for name, worker in (("full", full), ("mixed", mixed))}
    assert metrics["mixed"]["actor/pg_loss"] == pytest.approx(metrics["full"]["actor/pg_loss"], abs=0.02)
    assert metrics["mixed"]["actor/grad_norm"] == pytest.approx(metrics["full"]["actor/grad_norm"], rel=0.1)
    for parameter in mixed.model.parameters():
        assert parameter.dtype == parameter.grad.dtype == torch.float32
        state = mixed.optimizer.state[parameter]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_token_budget_bins_hold_every_sample_once_within_the_budget():
    rows = ragged_rows(40)
    batch = padded_batch(rows)
    prompts, responses = spans(batch)
    assert prompts == [len(p) for p, _ in rows] and responses == [len(r) for _, r in rows]
    for budget in (22, 40, 97, 1000):
        bins = pack(prompts, responses, budget)
        assert sorted(row for rows_ in bins for row in rows_) == list(range(40))
        for rows_ in bins:
            assert len(rows_) * (max(prompts[r] for r in rows_) + max(responses[r] for r in rows_)) <= budget
        more = equalise(bins, len(bins) + 3)
        assert len(more) == len(bins) + 3 and sorted(r for rows_ in more for r in rows_) == list(range(40))
    assert len(pack(prompts, responses, 1000)) == 1
    with pytest.raises(ValueError, match="longer than the micro-batch budget of 21 tokens"):
        pack(prompts, responses, 21)


def test_a_token_budget_split_gives_the_row_splits_log_probs_and_gradient(tiny_model_dir):
    rows = ragged_rows(8, seed=1)
    by_rows = policy(tiny_model_dir, rows=8)
    by_tokens = policy(tiny_model_dir, rows=8, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40)
    batch = training_batch(by_rows, rows)
    assert len(split(batch, 8, 40).micros) > 2
    restored = by_tokens.compute_log_prob(batch).batch["old_log_probs"]
    mask = batch.batch["response_mask"].bool()  # past a response, each split computes other padding
    assert torch.allclose(restored[mask], batch.batch["old_log_probs"][mask], atol=1e-5)
    metrics = [worker.update(batch) for worker in (by_rows, by_tokens)]
    assert metrics[0]["actor/pg_loss"] == pytest.approx(metrics[1]["actor/pg_loss"], rel=1e-5)
    for a, b in zip(by_rows.model.parameters(), by_tokens.model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)


def test_offloaded_weights_and_adam_state_go_to_the_host_after_each_call_and_change_no_update(tiny_model_dir):
    """On this CPU host and device are one, so what is checked is the order (each call brings
    both to the device once, nested calls included, and parks them after) and that the update
    is the plain one; docs/gpus.md lists the GPU check."""
    plain = policy(tiny_model_dir, use_kl_loss=True)
    offloaded = policy(
        tiny_model_dir,
        use_kl_loss=True,
        ref_param_offload=True,
        fsdp_config=FsdpConfig(param_offload=True, optimizer_offload=True),
    )
    colocated = policy(tiny_model_dir, use_kl_loss=True, colocated=True)  # verl's hybrid engine: no key needed
    for worker in (plain, offloaded, colocated):
        batch = training_batch(worker, ROWS)
        batch.batch["ref_log_prob"] = worker.compute_ref_log_prob(batch).batch["ref_log_prob"]
        worker.update(batch)
    calls = 2  # compute_log_prob, update (its update_share nested inside)
    assert offloaded.offload.moves == {
        "weights to host": calls + 1,  # and once when built
        "optimizer to host": calls + 1,
        "weights to device": calls,
        "optimizer to device": calls,
    }
    assert offloaded.reference_offload.moves == {"weights to host": 2, "weights to device": 1}
    assert colocated.offload.moves == offloaded.offload.moves
    assert colocated.reference_offload.moves == offloaded.reference_offload.moves
    assert plain.offload.moves == {} and plain.reference_offload.moves == {}
    for a, b in zip(plain.model.parameters(), offloaded.model.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad) and b.device.type == "cpu"
    assert all(v.device.type == "cpu" for state in offloaded.optimizer.state.values() for v in state.values())
