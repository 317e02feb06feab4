"""GRPO does what it should on the embedded task, end to end with the real pieces: rollouts of the
agent loop on the hf backend with the calculator, the task's exact-match score, GRPO advantages and
the policy worker's PPO update. On one fixed batch, repeated updates raise the likelihood of the
responses that beat their group and lower the others', and the same prompts, re-sampled with the
same random streams, score higher."""

import numpy as np
import pytest
import torch
from skip_core.backend import create_backend
from skip_core.batch import Batch
from skip_core.sections import Sections
from skip_plugin_arithmetic import warmup
from skip_plugin_arithmetic.calculator import SCHEMA, Calculator
from skip_plugin_arithmetic.task import demonstration, problems, prompt, score
from skip_plugin_hf.options import HFOptions
from skip_plugin_trainer.algorithms.advantages import grpo
from skip_plugin_trainer.algorithms.contract import AdvantageInputs
from skip_plugin_trainer.config.algorithm import ActorConfig, AlgorithmConfig, Optim
from skip_plugin_trainer.config.sections import LoopConfig
from skip_plugin_trainer.reward import place_on_last_token
from skip_plugin_trainer.rollout.agent_loop import AgentLoop
from skip_plugin_trainer.rollout.tools import HermesParser
from skip_plugin_trainer.train.policy import Policy

pytestmark = pytest.mark.integration  # GRPO updates of the embedded model

PROBLEMS = problems("learning-test", 8, seed=0)
SAMPLES = 8  # per prompt: a GRPO group
# PPO steps on the one batch. Small ones: Adam moves every weight by about lr per step, and on
# a batch this size a few steps at lr 1e-3 take the model far from where the gradient holds.
UPDATES = 8
LR = 2e-5


@pytest.fixture(scope="module")
def primed_dir(tiny_model_dir, tmp_path_factory):
    """The session's tiny model, briefly trained on PROBLEMS' own demonstrations, each ending
    both ways (``Answer: <result>`` and the restated equation), as the embedded default's
    warm-up does: right on some samples and wrong on others, what GRPO needs to compare."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    conversations = [demonstration(*problem, graded=graded) for problem in PROBLEMS for graded in (True, False)]
    warmup.warm_up(model, tokenizer, conversations, [SCHEMA], steps=60, batch_size=8, progress=False)
    target = tmp_path_factory.mktemp("primed")
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def prompts() -> Batch:
    return Batch.from_dict(
        non_tensors={
            "raw_prompt": [prompt(expression) for expression, _ in PROBLEMS],
            "tools_kwargs": [{"calculator": {}}] * len(PROBLEMS),
        },
        meta_info={"global_steps": 1},  # the same step seeds every sample the same way each time
    )


def scores(loop: AgentLoop, batch: Batch) -> np.ndarray:
    texts = loop.tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    truths = [answer for _, answer in PROBLEMS for _ in range(SAMPLES)]
    return np.array([score(text, truth) for text, truth in zip(texts, truths, strict=True)])


def sequence_log_probs(policy: Policy, batch: Batch) -> torch.Tensor:
    return (policy.compute_log_prob(batch).batch["old_log_probs"] * batch.batch["response_mask"]).sum(-1)


def test_grpo_updates_on_one_batch_favour_what_scored_and_the_batch_scores_higher(primed_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(primed_dir)
    backend = create_backend("hf", Sections(HFOptions(device="cpu")), primed_dir)
    config = LoopConfig(prompt_length=160, response_length=96, n=SAMPLES, temperature=1.0, seed=0)
    loop = AgentLoop(backend, tokenizer, config, {"calculator": Calculator()}, HermesParser())
    actor = ActorConfig(ppo_mini_batch_size=len(PROBLEMS), ppo_micro_batch_size=len(PROBLEMS) * SAMPLES)
    policy = Policy(str(primed_dir), actor.model_copy(update={"optim": Optim(lr=LR)}), samples_per_prompt=SAMPLES)
    try:
        batch = loop.generate_sequences(prompts())
        before = scores(loop, batch)
        mask = batch.batch["response_mask"]
        groups = np.repeat(np.arange(len(PROBLEMS)), SAMPLES)
        inputs = AdvantageInputs(place_on_last_token(before, mask), mask, groups)
        advantages, _ = grpo(inputs, AlgorithmConfig())
        batch.batch["advantages"] = advantages
        start = sequence_log_probs(policy, batch)
        for _ in range(UPDATES):
            batch.batch["old_log_probs"] = policy.compute_log_prob(batch).batch["old_log_probs"]
            metrics = policy.update(batch)
            assert metrics["actor/grad_norm"] > 0
        change = sequence_log_probs(policy, batch) - start

        loop.update_weights(policy.state_dict())
        after = scores(loop, loop.generate_sequences(prompts()))
    finally:
        loop.shutdown()

    advantage = advantages[:, 0]
    rose = (change[advantage > 0] > 0).float().mean()
    print(f"score {before.mean():.3f} -> {after.mean():.3f}; {rose:.0%} of the winners rose")
    assert 0.1 <= before.mean() <= 0.9, "the primed model should be right on some samples, not all"
    assert change[advantage > 0].mean() > 0 > change[advantage < 0].mean()
    assert rose >= 0.85
    assert after.mean() >= before.mean() + 0.06
