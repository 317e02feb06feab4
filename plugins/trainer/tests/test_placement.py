"""Where a GPU run's workers go (``placement.py``): the plan and its refusals, and the real Ray
placement on a Ray that declares 8 GPUs on this CPU machine (``placement_probe.py``): colocated,
each actor rank has a GPU of its own and shares it with its engine or the engine's shard."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from skip_core.config import ConfigError
from skip_plugin_trainer.config.placement import Bundle, plan
from skip_plugin_trainer.config.sections import Resources

PROBE = Path(__file__).with_name("placement_probe.py")
GPU = {"trainer.device": "cuda", "resources.actor.gpus_per_worker": 1, "resources.rollout.cpus_per_worker": 0.25}


def resources(**sections) -> Resources:
    return Resources.model_validate(sections)


def test_colocated_gpus_each_hold_one_rank_and_one_engine_shard():
    placed = plan(
        resources(colocate=True, actor={"workers": 4, "gpus_per_worker": 1}, rollout={"workers": 2}), 2, "cuda"
    )
    assert placed.hybrid and placed.bundles == (
        Bundle(1, 0, 0, 0), Bundle(1, 1, 0, 1), Bundle(1, 2, 1, 0), Bundle(1, 3, 1, 1)
    )  # fmt: skip
    assert placed.lines()[2:] == [
        "       0     1           0       0        0",
        "       1     1           1       0        1",
        "       2     1           2       1        0",
        "       3     1           3       1        1",
    ]


def test_separate_pools_give_each_engine_its_gpus_and_each_rank_its_own():
    pools = resources(actor={"workers": 2, "gpus_per_worker": 1}, rollout={"workers": 1, "gpus_per_worker": 2})
    placed = plan(pools, 2, "cuda")
    assert not placed.hybrid and placed.bundles == (Bundle(2, None, 0), Bundle(1, 0, None), Bundle(1, 1, None))
    assert plan(resources(actor={"workers": 2}), 1, "cpu").lines() == []  # nothing placed on a device


@pytest.mark.parametrize(
    ("sections", "tp", "message"),
    [
        (
            {"colocate": True, "actor": {"gpus_per_worker": 0.5}},
            1,
            "resources.actor.gpus_per_worker: colocated, each actor rank has one GPU, shared with its engine "
            "(not 0.5); set 1",
        ),
        (
            {"colocate": True, "actor": {"workers": 3, "gpus_per_worker": 1}, "rollout": {"workers": 1}},
            2,
            "resources.rollout.workers: colocated, 3 GPUs (resources.actor.workers) hold no whole number of engines "
            "of tensor parallel 2, not 1",
        ),
        (
            {"colocate": True, "actor": {"workers": 4, "gpus_per_worker": 1}, "rollout": {"gpus_per_worker": 1}},
            2,
            "resources.rollout.gpus_per_worker: colocated, an engine spans its tensor-parallel size, 2 GPUs",
        ),
        (
            {"actor": {"gpus_per_worker": 1}, "rollout": {"gpus_per_worker": 1}},
            2,
            "resources.rollout.gpus_per_worker: an engine of tensor parallel 2 needs 2 GPUs (not 1)",
        ),
        (
            {"actor": {"workers": 2, "gpus_per_worker": 0.5}},
            1,
            "resources.actor.gpus_per_worker: 0.5 puts two of the 2 actor ranks on one GPU, which NCCL refuses",
        ),
    ],
)
def test_numbers_that_cannot_be_placed_are_one_line_naming_the_key(sections, tp, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        plan(resources(**sections), tp, "cuda")


def probe(overrides: dict) -> dict:
    done = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(overrides)], capture_output=True, text=True, timeout=300, check=True
    )
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("placed: ")]
    return json.loads(line.removeprefix("placed: "))


@pytest.mark.integration  # a Ray that declares 8 GPUs, in a process of its own
def test_colocated_on_eight_gpus_each_rank_has_its_gpu_and_shares_it_with_its_engine_and_critic_rank():
    overrides = {**GPU, "resources.colocate": True, "resources.actor.workers": 8, "resources.rollout.workers": 8}
    placed = probe({**overrides, "algorithm.adv_estimator": "gae"})
    ranks = {worker["rank"]: worker["gpus"] for worker in placed["ranks"]}
    assert sorted(gpu for gpus in ranks.values() for gpu in gpus) == [str(gpu) for gpu in range(8)]  # one each
    assert {worker["rank"]: worker["gpus"] for worker in placed["engines"]} == ranks  # engine i on rank i's GPU
    assert {worker["rank"]: worker["gpus"] for worker in placed["critic"]} == ranks


@pytest.mark.integration  # a Ray that declares 8 GPUs, in a process of its own
def test_colocated_engines_of_two_gpus_get_their_ranks_gpus():
    overrides = {**GPU, "resources.colocate": True, "resources.actor.workers": 8, "resources.rollout.workers": 4}
    overrides |= {"rollout.backend": "vllm", "rollout.engine_kwargs.vllm.tensor_parallel_size": 2}
    placed = probe(overrides)
    ranks = {worker["rank"]: worker["gpus"][0] for worker in placed["ranks"]}
    assert len(set(ranks.values())) == 8
    for engine in placed["engines"]:
        first, second = ranks[2 * engine["rank"]], ranks[2 * engine["rank"] + 1]
        assert engine["gpus"] == [first] and engine["devices"] == f"{first},{second}"
