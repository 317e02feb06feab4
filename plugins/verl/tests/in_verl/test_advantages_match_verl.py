"""skip's advantage estimators against verl 0.9.1's registered ones, on the same random batches:
groups of several sizes (one alone; one of 17, where ``torch.mean`` and a scatter-add round the
same scores differently), rows in no order of group, tool-response gaps in the mask, a response
without loss tokens, and a group whose equal scores do not add up exactly (its std is rounding
noise, which the advantages divide by). verl gets what its trainer's ``compute_advantage`` passes, and its config as
``AlgoConfig`` or as the OmegaConf node of its YAML trainer.

skip's are 0 off the mask, where verl leaves some values nobody reads, so verl's are compared
times the mask. Where skip applies ``norm_adv_by_std_in_grpo`` and verl's trainer does not pass
it (``grpo_vectorized``, ``gdpo``), verl's function is given it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from skip_plugin_trainer.algorithms.advantages import ESTIMATORS
from skip_plugin_trainer.algorithms.contract import AdvantageInputs
from skip_plugin_trainer.config.algorithm import AlgorithmConfig
from torch.testing import assert_close
from verl.protocol import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage

SKIP = {estimator.name: estimator for estimator in ESTIMATORS}
SIZES = (1, 2, 3, 4, 6, 17)
WIDTH = 12
PROMPT = 3
KEYS = ("format", "accuracy")
SEEDS = range(6)
OTB = ("optimal_token_baseline", "tir_optimal_token_baseline")


@dataclass(frozen=True)
class Case:
    rewards: torch.Tensor
    mask: torch.Tensor  # int64, as verl's trainer cuts it from the attention mask
    index: np.ndarray
    values: torch.Tensor
    reward_baselines: torch.Tensor
    old_log_probs: torch.Tensor
    sum_pi_squared: torch.Tensor
    rollout_is_weights: torch.Tensor | None
    parts: dict[str, np.ndarray]
    attention_mask: torch.Tensor
    gamma: float
    lam: float
    norm: bool
    weights: tuple[float, ...] | None


def make_case(seed: int, sizes: tuple[int, ...] = SIZES) -> Case:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    group = np.repeat(np.arange(len(sizes)), sizes)
    order = rng.permutation(len(group))
    group, batch = group[order], len(group)
    index = np.array([f"uid-{seed}-{g}" for g in group], dtype=object)
    lengths = torch.randint(1, WIDTH + 1, (batch,), generator=gen)
    lengths[0] = WIDTH  # a response cut at the width: a loss token in the last column
    steps = torch.arange(WIDTH)
    in_response = steps < lengths.unsqueeze(-1)
    mask = in_response.long()
    gapped = (lengths >= 6) & (torch.rand(batch, generator=gen) < 0.5)
    mask[gapped, 2:4] = 0  # a tool's response inside the answer
    big = int(np.flatnonzero(np.asarray(sizes) > 2)[-1])  # a row of a group of several...
    mask[int(np.flatnonzero(group == big)[0])] = 0  # ...with no loss token at all

    last = (mask * (steps + 1)).argmax(dim=-1)  # the last loss token, where a reward manager puts the score
    outcome = torch.where(torch.rand(batch, generator=gen) < 0.5, 1.0, 0.0) + 0.1 * torch.randn(batch, generator=gen)
    noise = 0.01 * torch.randn(batch, WIDTH, generator=gen) * in_response  # a KL penalty in the reward
    rewards = noise.index_put((torch.arange(batch), last), outcome, accumulate=True)
    equal = torch.as_tensor(group == len(sizes) - 1)  # the last group: all 0.1, exactly
    rewards[equal] = 0.0
    rewards[equal, last[equal]] = 0.1

    pi = torch.rand(batch, WIDTH, generator=gen) * 0.95 + 0.05
    parts = {key: rng.choice([0.0, 0.1, 0.5, 1.0], size=batch).astype(np.float32) for key in KEYS}
    parts["format"][equal.numpy()] = 0.1
    response_attention = in_response.long()
    return Case(
        rewards=rewards,
        mask=mask,
        index=index,
        values=torch.randn(batch, WIDTH, generator=gen),
        reward_baselines=torch.randn(batch, generator=gen),
        old_log_probs=torch.log(pi),
        sum_pi_squared=pi**2 + torch.rand(batch, WIDTH, generator=gen) * (1 - pi) ** 2,
        rollout_is_weights=None if seed % 2 else torch.rand(batch, WIDTH, generator=gen) * 1.5 + 0.5,
        parts=parts,
        attention_mask=torch.cat([torch.ones(batch, PROMPT, dtype=torch.long), response_attention], dim=-1),
        gamma=(1.0, 0.9, 0.99)[seed % 3],
        lam=(1.0, 0.95)[seed % 2],
        norm=seed % 3 != 1,
        weights=None if seed % 2 else (0.5, 2.0),
    )


def verl_config(case: Case, name: str, seed: int) -> Any:
    settings = {
        "adv_estimator": name,
        "gamma": case.gamma,
        "lam": case.lam,
        "norm_adv_by_std_in_grpo": case.norm,
        "gdpo_reward_keys": list(KEYS),
        "gdpo_reward_weights": None if case.weights is None else list(case.weights),
    }
    return AlgoConfig(**settings) if seed % 2 else OmegaConf.create(settings)


def verl_kwargs(case: Case, name: str, config: Any) -> dict[str, Any]:
    """The arguments verl's ``compute_advantage`` gives the estimator ``name``."""
    tensors = {"token_level_rewards": case.rewards.clone(), "response_mask": case.mask.clone()}
    if name == "gae":
        return tensors | {"values": case.values.clone(), "gamma": case.gamma, "lam": case.lam}
    if name == "grpo":
        return tensors | {"index": case.index, "norm_adv_by_std_in_grpo": case.norm}
    kwargs = tensors | {"config": config, "index": case.index}
    if name == "remax":
        kwargs["reward_baselines"] = case.reward_baselines.clone()
    if name == "gdpo":
        batch = {"prompts": torch.zeros(len(case.index), PROMPT, dtype=torch.long)}
        kwargs |= {"non_tensor_batch": {"uid": case.index, **case.parts}, "batch": batch}
        kwargs["batch"]["attention_mask"] = case.attention_mask
    if name in OTB:
        kwargs |= {"sum_pi_squared": case.sum_pi_squared, "old_log_probs": case.old_log_probs}
        kwargs["rollout_is_weights"] = case.rollout_is_weights
    return kwargs


def run_verl(case: Case, name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    kwargs = verl_kwargs(case, name, verl_config(case, name, seed))
    if name in ("grpo_vectorized", "gdpo"):  # verl's trainer leaves it at its default, True
        kwargs["norm_adv_by_std_in_grpo"] = case.norm
    return core_algos.get_adv_estimator_fn(name)(**kwargs)


def run_skip(case: Case, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """skip's estimator given only what its ``needs`` names, besides rewards, mask and groups."""
    estimator = SKIP[name]
    optional = {
        "values": case.values,
        "reward_baselines": case.reward_baselines,
        "old_log_probs": case.old_log_probs,
        "sum_pi_squared": case.sum_pi_squared,
        "rollout_is_weights": case.rollout_is_weights,
        "scores": {key: torch.from_numpy(part) for key, part in case.parts.items()},
    }
    inputs = AdvantageInputs(
        token_level_rewards=case.rewards.clone(),
        response_mask=case.mask.clone(),
        index=case.index,
        **{
            key: value.clone() if torch.is_tensor(value) else value
            for key, value in optional.items()
            if key in estimator.needs
        },
    )
    config = AlgorithmConfig(
        adv_estimator=name,
        gamma=case.gamma,
        lam=case.lam,
        norm_adv_by_std_in_grpo=case.norm,
        gdpo_reward_keys=KEYS,
        gdpo_reward_weights=case.weights,
    )
    return estimator.compute(inputs, config)


def sizes_for(name: str) -> tuple[int, ...]:
    return tuple(size for size in SIZES if size > 1) if name == "grpo_passk" else SIZES  # verl refuses one alone


def test_skip_registers_verls_estimators_by_their_names():
    names = [estimator.name for estimator in ESTIMATORS]
    assert len(names) == len(set(names))
    assert set(names) == set(core_algos.ADV_ESTIMATOR_REGISTRY)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(core_algos.ADV_ESTIMATOR_REGISTRY))
def test_advantages_and_returns_match_verls(name, seed):
    case = make_case(seed, sizes_for(name))
    theirs = run_verl(case, name, seed)
    ours = run_skip(case, name)
    mask = case.mask.float()
    for what, mine, verls in zip(("advantages", "returns"), ours, theirs, strict=True):
        assert mine.dtype == torch.float32, what
        assert_close(mine, verls * mask, atol=1e-6, rtol=1e-5, msg=lambda m, what=what: f"{name} {what}: {m}")
        assert not mine[mask == 0].any(), f"{name} {what}: nonzero off the mask"


@pytest.mark.parametrize("name", sorted(core_algos.ADV_ESTIMATOR_REGISTRY))
def test_the_arguments_given_verls_functions_are_its_trainers(name):
    """``verl_kwargs`` against verl's own ``compute_advantage`` on a ``DataProto``, so the
    comparison above is with what verl's trainer computes (``norm_adv_by_std_in_grpo`` on)."""
    case = replace(make_case(0, sizes_for(name)), norm=True)
    config = verl_config(case, name, 0)
    tensors = {
        "token_level_rewards": case.rewards,
        "response_mask": case.mask,
        "values": case.values,
        "old_log_probs": case.old_log_probs,
        "sum_pi_squared": case.sum_pi_squared,
        "rollout_is_weights": case.rollout_is_weights,
        "prompts": torch.zeros(len(case.index), PROMPT, dtype=torch.long),
        "attention_mask": case.attention_mask,
    }
    if name == "remax":  # verl's trainer has it in the batch only for ReMax
        tensors["reward_baselines"] = case.reward_baselines
    data = DataProto.from_dict(
        tensors={key: value.clone() for key, value in tensors.items() if value is not None},
        non_tensors={"uid": case.index, **case.parts},
    )
    data = compute_advantage(data, name, gamma=case.gamma, lam=case.lam, norm_adv_by_std_in_grpo=True, config=config)
    direct = core_algos.get_adv_estimator_fn(name)(**verl_kwargs(case, name, config))
    assert_close(data.batch["advantages"], direct[0], atol=0, rtol=0)
    assert_close(data.batch["returns"], direct[1], atol=0, rtol=0)


def test_grpo_passk_refuses_a_response_alone_as_verl_does():
    case = make_case(0)
    with pytest.raises(ValueError):
        run_verl(case, "grpo_passk", 0)
    with pytest.raises(ValueError, match="at least 2"):
        run_skip(case, "grpo_passk")
