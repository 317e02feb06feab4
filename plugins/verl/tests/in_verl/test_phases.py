"""Roles ``reward``, ``old_log_prob``, ``ref_log_prob`` and ``values`` inside verl 0.9.1's V1 trainer.

verl's real ``fit()`` (``v1.fit``) with every phase of the step on: a colocated reward model,
recomputed old log-probs (``bypass_mode=False``), a reference policy (``use_kl_loss``) and a
critic (``gae``). Only the worker groups are scripted; like verl's, they write their outputs into
TransferQueue, drawn at random on every call, so a replay that called one would log other
numbers. The actor's and critic's updates report sums that pair each row's phase outputs with
its own response, so a cached output written to another row changes them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transfer_queue as tq
import v1
from omegaconf import open_dict
from skip_core import hookimpl
from skip_core.batch import Batch
from skip_core.caching import PromptMismatchError, PromptMismatchWarning
from skip_core.plugins import pm
from skip_core.store import CacheStore, CacheWarning
from skip_plugin_verl import phases
from tensordict import TensorDict

ROLES = ("reward", "old_log_prob", "ref_log_prob", "values")
SKIP_FILES = {"meta.json", "data.json", "tensors.safetensors"}
STEPS = (1, 2, 3)


@pytest.fixture(scope="session")
def transfer_queue():
    v1.start_transfer_queue()


@pytest.fixture(autouse=True)
def _empty_partition(transfer_queue):
    yield
    for uid in list(tq.kv_list(v1.PARTITION).get(v1.PARTITION, {})):  # a run that raised leaves its keys
        tq.kv_clear(keys=[uid], partition_id=v1.PARTITION)


class Workers:
    """The worker groups the phases call, each counting its calls and writing what verl's writes."""

    def __init__(self) -> None:
        self.random = random.Random(os.urandom(8))
        self.calls: dict[str, int] = {}
        self.trained: dict[tuple, list] = {}  # (prompt, response) -> the phases' outputs the actor got for it

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _per_token(self, batch, name: str):
        """Random values over each row's prompt and response, as verl's model outputs are."""
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts", "responses"])
        lengths = (data["prompts"].offsets().diff() + data["responses"].offsets().diff()).tolist()
        rows = [torch.tensor([self.random.uniform(-3, 0) for _ in range(n)]) for n in lengths]
        fields = TensorDict({name: torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, batch_size=[len(rows)])
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)

    # actor_rollout_wg
    def compute_log_prob(self, batch):
        self._count("compute_log_prob")
        self._per_token(batch, "entropy")
        return self._per_token(batch, "log_probs")

    def update_actor(self, batch):
        self._count("update_actor")
        names = ["rm_scores", "old_log_probs", "ref_log_prob", "values"]
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts", "responses", "judge", *names]
        )
        judges = list(data["judge"])  # the reward's extra field, one string per row
        for i in range(len(batch)):
            row = (tuple(data["prompts"][i].tolist()), tuple(data["responses"][i].tolist()))
            outputs = tuple(tuple(data[name][i].tolist()) for name in names)
            self.trained.setdefault(row, []).append((*outputs, judges[i]))
        sums = _paired(batch, ["advantages", "old_log_probs", "ref_log_prob", "entropy"])
        return {"metrics": {**{f"{name}_paired": [value] for name, value in sums.items()}, "mfu": [0.0]}}

    def save_model_to_cpu(self, n):
        self._count("save_model_to_cpu")

    def restore_model_from_cpu(self, n):
        self._count("restore_model_from_cpu")

    def clear_cpu_model(self, n):
        self._count("clear_cpu_model")

    # ref_policy_wg
    def compute_ref_log_prob(self, batch):
        self._count("compute_ref_log_prob")
        return self._per_token(batch, "log_probs")

    # critic_wg
    def infer_batch(self, batch):
        self._count("infer_batch")
        self._per_token(batch, "values")
        return SimpleNamespace(futures=[])

    def train_mini_batch(self, batch):
        self._count("train_mini_batch")
        sums = _paired(batch, ["values", "returns"])
        return SimpleNamespace(get=lambda: {"metrics": {"vf_loss": [sums["returns"]], "mfu": [0.0]}})

    # reward_loop_manager
    reward_loop_worker_handles = None

    def compute_rm_score(self, data):
        from verl.protocol import DataProto

        self._count("compute_rm_score")
        scores = torch.tensor([[self.random.random() for _ in range(data.batch["responses"].shape[1])] for _ in data])
        judge = np.array([f"judge-{self.random.randrange(1000)}" for _ in data], dtype=object)
        return DataProto.from_dict(
            tensors={"rm_scores": scores}, non_tensors={"judge": judge}, meta_info={"reward_extra_keys": ["judge"]}
        )


def _paired(batch, names: list[str]) -> dict[str, float]:
    """Per field, the sum over rows of (the row's values) x (its response's token sum + 1): order-free,
    but not free of which row got which values."""
    fields = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["responses", *names])
    weights = [float(row.sum()) + 1 for row in fields["responses"].unbind()]
    present = set(fields.keys())  # a phase that is off left no field
    return {
        name: sum(float(row.sum()) * w for row, w in zip(fields[name].unbind(), weights, strict=True))
        for name in names
        if name in present
    }


def config(dump_dir: Path, mode: str = "sync", roles=ROLES, rollout_tq: bool = True, **settings):
    """verl's config (``v1.verl_config``) with every phase on and ``skip.<role>`` for ``roles``."""
    composed = v1.verl_config(dump_dir, mode, STEPS, enable=rollout_tq)
    with open_dict(composed):
        for role in roles:
            section = {"enable": True, "dump_dir": str(dump_dir), "steps": list(STEPS), "action": "cache", **settings}
            composed.skip[role] = section
        composed.algorithm.rollout_correction.bypass_mode = False
        composed.algorithm.adv_estimator = "gae"
        composed.actor_rollout_ref.actor.use_kl_loss = True
    return composed


def fit(composed, monkeypatch, shuffle: bool = False) -> SimpleNamespace:
    """``v1.fit`` of the trainer class for the mode, with ``Workers`` as every worker group."""
    from verl.trainer.ppo.v1 import trainer_base

    mode = composed.trainer.v1.trainer_mode
    workers = Workers()

    class WithWorkers(trainer_base.get_trainer_cls(mode)):
        def on_train_begin(self):  # verl's hook before the first step: after fit() set up the rest
            self.tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=0)
            self.actor_rollout_wg = self.ref_policy_wg = self.critic_wg = workers
            self.ref_in_actor = False
            self.reward_loop_manager = workers  # no reward loop workers: the reward model runs colocated
            if shuffle:  # the replay buffer may hand out the trajectories of a step in any order
                self.replay_buffer.sample = functools.partial(_shuffled, self.replay_buffer.sample, workers.random)
            super().on_train_begin()

    with monkeypatch.context() as patch:
        patch.setitem(trainer_base.TRAINER_REGISTRY, mode, WithWorkers)
        done = v1.fit(composed, v1.prompts(0, count=4 * len(STEPS)))
    done.workers = workers
    return done


def _shuffled(sample, generator: random.Random, **kwargs):
    batch, metrics = sample(**kwargs)
    order = list(range(len(batch)))
    while len(order) > 1 and order == sorted(order):
        generator.shuffle(order)
    batch.reorder(order)
    return batch, metrics


def entries(dump_dir: Path, role: str) -> list[Path]:
    return sorted(path.parent for path in (dump_dir / "exp_proj" / role).rglob("meta.json"))


def test_every_phase_is_replayed_in_verls_fit_loop_without_a_worker_call(tmp_path, monkeypatch):
    first = fit(config(tmp_path), monkeypatch)
    assert first.workers.calls == {
        "compute_rm_score": 3,
        "compute_log_prob": 3,
        "compute_ref_log_prob": 3,
        "infer_batch": 3,
        "train_mini_batch": 3,
        "update_actor": 3,
    }
    for role in ROLES:
        assert [path.name for path in entries(tmp_path, role)] == ["1", "2", "3"], role
        for path in entries(tmp_path, role):
            assert {f.name for f in path.iterdir()} == SKIP_FILES  # data only: no pickle
    assert {"actor/entropy", "critic/vf_loss", "actor/ref_log_prob_paired"} <= set(first.metrics[0])

    again = fit(config(tmp_path), monkeypatch)
    assert again.workers.calls == {"train_mini_batch": 3, "update_actor": 3}
    assert again.agent_loop.prompts == 0
    assert again.metrics == first.metrics
    assert again.workers.trained == first.workers.trained


class Warps:
    """A third-party plugin's ``skip_warp``, first in line: it records each replacement and
    answers nothing (core's own warp then loads the entry), or fails when told to."""

    def __init__(self, failing: str | None = None) -> None:
        self.seen: list[tuple[str, int]] = []
        self.failing = failing

    @hookimpl(tryfirst=True)
    def skip_warp(self, role, hit):
        self.seen.append((role.name, hit.step))
        if role.name == self.failing:
            raise RuntimeError("the plugin's own store is down")


@contextlib.contextmanager
def registered(plugin: Warps) -> Iterator[Warps]:
    pm.register(plugin)
    try:
        yield plugin
    finally:
        pm.unregister(plugin)


def test_a_warp_plugin_replaces_every_phase_of_verls_fit_and_a_failing_one_has_it_computed(tmp_path, monkeypatch):
    first = fit(config(tmp_path), monkeypatch)
    with registered(Warps()) as warps:
        again = fit(config(tmp_path), monkeypatch)
    assert sorted(set(warps.seen)) == sorted((role, step) for role in (*ROLES, "rollout_tq") for step in STEPS)
    assert again.metrics == first.metrics

    failed = r"skip\.reward step 1: replacing the call from step 1 failed .*store is down"
    with registered(Warps(failing="reward")), pytest.warns(CacheWarning, match=failed):
        third = fit(config(tmp_path), monkeypatch)
    assert third.workers.calls == {"compute_rm_score": 3, "train_mini_batch": 3, "update_actor": 3}


def test_each_row_gets_the_outputs_of_its_own_input_whatever_the_order(tmp_path, monkeypatch):
    first = fit(config(tmp_path), monkeypatch)
    with warnings.catch_warnings():
        for category in (PromptMismatchWarning, CacheWarning):  # the same inputs: no mismatch, no fallback
            warnings.simplefilter("error", category)
        again = fit(config(tmp_path), monkeypatch, shuffle=True)
    assert again.workers.calls == {"train_mini_batch": 3, "update_actor": 3}
    assert again.workers.trained == first.workers.trained  # every output of every phase, by input
    for logged, replayed in zip(first.metrics, again.metrics, strict=True):  # float sums in another order
        assert replayed == pytest.approx(logged, rel=1e-4, abs=1e-5)


def test_a_run_without_skip_logs_other_numbers(tmp_path, monkeypatch):
    """What the replay test rests on: the scripted workers differ on every call."""
    first = fit(config(tmp_path, roles=()), monkeypatch)
    again = fit(config(tmp_path, roles=()), monkeypatch)
    assert again.workers.calls["compute_log_prob"] == 3
    for name in ("actor/entropy", "actor/old_log_probs_paired", "actor/ref_log_prob_paired", "critic/vf_loss"):
        assert again.metrics[0][name] != first.metrics[0][name], name


def test_separate_async_replays_each_call_of_a_step(tmp_path, monkeypatch):
    """Two calls a step (``parameter_sync_step=2``): each its own generation of the step's entry,
    and on the replay verl's weight juggling for old log-probs is not needed either."""
    first = fit(config(tmp_path, "separate_async"), monkeypatch)
    assert first.workers.calls["compute_log_prob"] == 6
    assert first.workers.calls["save_model_to_cpu"] == 6 and first.workers.calls["restore_model_from_cpu"] == 6
    paths = [path.relative_to(tmp_path / "exp_proj" / "old_log_prob") for path in entries(tmp_path, "old_log_prob")]
    assert sorted(path.parts[1:] for path in paths) == [
        ("1",),
        ("2",),
        ("3",),
        ("generation_1", "1"),
        ("generation_1", "2"),
        ("generation_1", "3"),
    ]

    again = fit(config(tmp_path, "separate_async"), monkeypatch)
    assert again.workers.calls == {"train_mini_batch": 6, "update_actor": 6}  # no save or restore of weights either
    assert again.metrics == first.metrics


def test_other_inputs_at_a_cached_step_raise_when_asked(tmp_path, monkeypatch):
    fit(config(tmp_path, roles=("old_log_prob",)), monkeypatch)
    fresh = config(tmp_path, roles=("old_log_prob",), rollout_tq=False, on_prompt_mismatch="error")
    with pytest.raises(PromptMismatchError, match=r"skip\.old_log_prob step 1:"):
        fit(fresh, monkeypatch)


def test_other_inputs_at_a_cached_step_are_computed_again_when_asked(tmp_path, monkeypatch):
    fit(config(tmp_path, roles=("reward", "values")), monkeypatch)
    before = {
        path: (path / "meta.json").read_bytes() for role in ("reward", "values") for path in entries(tmp_path, role)
    }
    fresh = config(tmp_path, roles=("reward", "values"), rollout_tq=False, on_prompt_mismatch="regenerate")
    again = fit(fresh, monkeypatch)
    assert again.workers.calls["compute_rm_score"] == 3 and again.workers.calls["infer_batch"] == 3
    assert all((path / "meta.json").read_bytes() != meta for path, meta in before.items())  # replaced


def test_bypass_mode_calls_no_worker_and_caches_nothing(tmp_path, monkeypatch):
    composed = config(tmp_path, roles=("old_log_prob",))
    composed.algorithm.rollout_correction.bypass_mode = True
    with pytest.warns(CacheWarning, match="bypass_mode is on"):
        fit(composed, monkeypatch)
    assert entries(tmp_path, "old_log_prob") == []


def test_a_failed_dump_is_a_warning_and_training_goes_on(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(CacheStore, "save", refuse)
    with pytest.warns(CacheWarning, match=r"skip\.values step 1: dump failed, training continues: OSError"):
        done = fit(config(tmp_path, roles=("values",)), monkeypatch)
    assert len(done.metrics) == 3


def test_rows_take_the_output_of_the_same_input_and_a_score_never_goes_to_another_response():
    cached = Batch(
        {"x": torch.arange(3)},
        {phases.PROMPT: np.array(["a", "b", "c"], dtype=object)},
        {phases.SIZES: [[1, 2], [1, 3], [1, 2]]},
    )
    assert phases._match(cached, ["c", "a", "b"], [[1, 2], [1, 2], [1, 3]], leftovers=False) == [2, 0, 1]
    # a mismatch loaded anyway: the row left over takes an unused row of the same input sizes
    assert phases._match(cached, ["b", "z"], [[1, 3], [1, 2]], leftovers=True) == [1, 0]
    assert phases._match(cached, ["b", "z"], [[1, 3], [1, 9]], leftovers=True) is None
    assert phases._match(cached, ["b", "z"], [[1, 3], [1, 2]], leftovers=False) is None


def test_separate_async_computes_a_later_call_under_the_current_weights_if_the_first_was_replayed(
    tmp_path, monkeypatch
):
    """Call 0 replayed, call 1 not (its entry is another run's): separate_async's override would
    restore weights saved at call 0, which never ran; the base computation runs instead."""
    fit(config(tmp_path / "a", "separate_async", roles=("old_log_prob",)), monkeypatch)
    fit(config(tmp_path / "b", "separate_async", roles=("old_log_prob",)), monkeypatch)
    store = Path("exp_proj", "old_log_prob", entries(tmp_path / "a", "old_log_prob")[0].parent.name, "generation_1")
    shutil.rmtree(tmp_path / "a" / store)
    shutil.copytree(tmp_path / "b" / store, tmp_path / "a" / store)
    composed = config(tmp_path / "a", "separate_async", roles=("old_log_prob",), on_prompt_mismatch="regenerate")
    with pytest.warns(CacheWarning, match="the weights it started from were never saved"):
        again = fit(composed, monkeypatch)
    assert again.workers.calls["compute_log_prob"] == 3  # call 1 of each step
    assert "save_model_to_cpu" not in again.workers.calls and "restore_model_from_cpu" not in again.workers.calls


def test_installing_again_wraps_each_class_once():
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    phases.install(lambda: 1)
    wrapped = {name: PPOTrainer.__dict__[name] for name in phases.PHASES}
    override = PPOTrainerSeparateAsync.__dict__["_compute_old_log_prob"]
    phases.install(lambda: 1)
    assert {name: PPOTrainer.__dict__[name] for name in phases.PHASES} == wrapped
    assert PPOTrainerSeparateAsync.__dict__["_compute_old_log_prob"] is override
    assert all(getattr(method, phases.WRAPPED) for method in [*wrapped.values(), override])
    assert override.__wrapped__.__qualname__ == "PPOTrainerSeparateAsync._compute_old_log_prob"
