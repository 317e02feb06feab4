"""``skip.rollout_tq`` in verl 0.9.1's V1 trainer, served by skip: verl's real ``fit()`` loop,
``ReplayBuffer`` and TransferQueue (``v1``), two runs each, the bridge installed as a user installs
it. Nothing here calls the decorated methods by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import skip_core
import torch
import v1
from safetensors import safe_open
from skip_core.caching import PromptMismatchError, PromptMismatchWarning
from skip_core.store import CacheWarning

from conftest import Planted

HERE = Path(__file__).resolve().parent
SHAPE = "GBS4_N2_in8_out8"
SKIP_FILES = {"meta.json", "data.json", "tensors.safetensors"}


@pytest.fixture(scope="module", autouse=True)
def transfer_queue():
    v1.start_transfer_queue()


def entries(dump_dir: Path) -> dict[str, list[int]]:
    """The rollout_tq entries skip wrote, by generation directory (``.`` for the first part)."""
    base = dump_dir / "exp_proj" / "rollout_tq" / SHAPE
    found: dict[str, list[int]] = {}
    for meta in base.rglob("[0-9]*/meta.json"):
        found.setdefault(str(meta.parent.parent.relative_to(base)), []).append(int(meta.parent.name))
    return {k: sorted(v) for k, v in found.items()}


def skip_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "skip_core", *args], capture_output=True, text=True, check=False)


@pytest.mark.parametrize(
    ("mode", "parts"), [("sync", ["."]), ("colocate_async", ["."]), ("separate_async", [".", "generation_1"])]
)
def test_a_second_fit_replays_every_step_without_the_agent_loop(tmp_path, mode, parts):
    first = v1.fit(v1.verl_config(tmp_path, mode=mode), v1.prompts(0))
    second = v1.fit(v1.verl_config(tmp_path, mode=mode), v1.prompts(0))

    assert first.agent_loop.prompts == 12 and second.agent_loop.prompts == 0
    assert entries(tmp_path) == {part: [1, 2, 3] for part in parts}
    assert len(second.metrics) == 3 and second.metrics == first.metrics
    assert second.actor.updates == first.actor.updates == 3 * len(parts)
    for path in (tmp_path / "exp_proj").rglob("*"):
        if path.is_file():
            assert path.name in SKIP_FILES, path  # data only: no pickle was written
    with safe_open(str(next((tmp_path / "exp_proj").rglob("tensors.safetensors"))), "pt") as tensors:
        assert any("jagged" in name for name in tensors.keys())  # noqa: SIM118 (safe_open is no dict)  # responses stay ragged, unpadded


def test_skip_cache_commands_read_the_entries(tmp_path):
    v1.fit(v1.verl_config(tmp_path, steps=(1, 2)), v1.prompts(0))
    listed = skip_cli("cache", "ls", str(tmp_path))
    checked = skip_cli("cache", "verify", str(tmp_path))
    tensors = tmp_path / "exp_proj" / "rollout_tq" / SHAPE / "2" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-8])
    caught = skip_cli("cache", "verify", str(tmp_path))
    pruned = skip_cli("cache", "prune", str(tmp_path))

    assert listed.returncode == 0 and listed.stdout.count("rollout_tq") >= 2, listed.stdout + listed.stderr
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert caught.returncode == 1 and "1 corrupt entry" in caught.stdout, caught.stdout + caught.stderr
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert entries(tmp_path) == {".": [1]}


def test_the_dataloader_stays_aligned_across_replayed_steps(tmp_path):
    """Only step 2 is cached: step 3, generated again, gets the prompts it got in the first run."""
    first = v1.fit(v1.verl_config(tmp_path, steps=(2,)), v1.prompts(0))
    recorder = v1.ScriptedAgentLoop(2)
    v1.fit(v1.verl_config(tmp_path, steps=(1, 2, 3)), v1.prompts(0), agent_loop=recorder)

    assert [len(batch) for batch in first.agent_loop.asked] == [4, 4, 4]
    assert recorder.asked == [first.agent_loop.asked[0], first.agent_loop.asked[2]]


def test_another_prompt_set_is_a_mismatch_never_silently_remapped(tmp_path):
    v1.fit(v1.verl_config(tmp_path), v1.prompts(0))

    with pytest.raises(PromptMismatchError, match=r"skip\.rollout_tq step 1: .*on_prompt_mismatch=error"):
        v1.fit(v1.verl_config(tmp_path, on_prompt_mismatch="error"), v1.prompts(1))
    skip_core.SkipManager.reset()
    regenerated = v1.fit(v1.verl_config(tmp_path, on_prompt_mismatch="regenerate"), v1.prompts(1))
    replayed = v1.fit(v1.verl_config(tmp_path, on_prompt_mismatch="error"), v1.prompts(1))

    assert regenerated.agent_loop.prompts == 12  # and its dumps replaced the entries
    assert replayed.agent_loop.prompts == 0 and replayed.metrics == regenerated.metrics


def test_a_mismatch_replayed_with_warn_says_so(tmp_path):
    v1.fit(v1.verl_config(tmp_path, steps=(1,), total=1), v1.prompts(0))

    with pytest.warns(PromptMismatchWarning, match="skip.rollout_tq step 1"):
        replayed = v1.fit(v1.verl_config(tmp_path, steps=(1,), total=1), v1.prompts(1))

    assert replayed.agent_loop.prompts == 0


def test_repeat_trains_every_step_on_the_nearest_dumped_one(tmp_path):
    first = v1.fit(v1.verl_config(tmp_path, steps=(1,), total=1), v1.prompts(0))
    repeated = v1.fit(v1.verl_config(tmp_path, steps=(1, 2, 3), action="repeat"), v1.prompts(0))

    assert repeated.agent_loop.prompts == 0 and entries(tmp_path) == {".": [1]}
    for step in repeated.metrics:
        assert step["critic/score/mean"] == first.metrics[0]["critic/score/mean"]
        assert step["response_length/mean"] == first.metrics[0]["response_length/mean"]


def test_a_planted_verl_dump_never_runs_and_is_pointed_at(tmp_path):
    """verl's own code would ``torch.load(weights_only=False)`` this file at a hit on step 1."""
    planted = tmp_path / "exp_proj" / SHAPE / "1" / "0"
    planted.mkdir(parents=True)
    marker = tmp_path / "executed"
    torch.save({"tensordict": Planted(marker)}, planted / "tq_batch.pt", _use_new_zipfile_serialization=True)
    (planted / "meta.json").write_text(json.dumps({"global_steps": 1, "num_trajectories": 8}))

    with pytest.warns(UserWarning, match=r"1 verl dump\(s\) .*tq_batch.pt, pickles.* import-verl .* --trust-pickle`"):
        run = v1.fit(v1.verl_config(tmp_path), v1.prompts(0))

    assert not marker.exists() and (planted / "tq_batch.pt").exists()
    assert run.agent_loop.prompts == 12


def test_verls_own_dumps_are_imported_and_replay_exactly(tmp_path):
    """verl's own code dumps two steps (``torch.save``); ``import-verl`` converts them; skip's replay
    never calls the agent loop and logs the metrics verl's run logged."""
    verl_dir, skip_dir = tmp_path / "verl", tmp_path / "skip"
    done = subprocess.run(
        [sys.executable, str(HERE / "verl_dump.py"), str(verl_dir)],
        env={**os.environ, "SKIP_PLUGINS": "skip-plugin-rollout"},  # the bridge left out
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    verl_run = json.loads(done.stdout.strip().splitlines()[-1])
    assert verl_run["served_by"] is None
    assert sorted(p.relative_to(verl_dir).parts[-3:] for p in verl_dir.rglob("tq_batch.pt")) == [
        ("1", "0", "tq_batch.pt"),
        ("2", "0", "tq_batch.pt"),
    ]

    imported = skip_cli("cache", "import-verl", str(verl_dir), str(skip_dir), "--trust-pickle")
    replay = v1.fit(v1.verl_config(skip_dir, steps=(1, 2), total=2), v1.prompts(0))

    assert imported.returncode == 0 and "imported 2 entries" in imported.stdout, imported.stdout + imported.stderr
    assert entries(skip_dir) == {".": [1, 2]}
    assert replay.agent_loop.prompts == 0
    assert json.loads(json.dumps(replay.metrics)) == verl_run["metrics"]


def test_a_corrupt_entry_is_generated_again_with_a_warning(tmp_path):
    v1.fit(v1.verl_config(tmp_path, steps=(1,), total=1), v1.prompts(0))
    tensors = next((tmp_path / "exp_proj").rglob("tensors.safetensors"))
    tensors.write_bytes(tensors.read_bytes()[:-8])

    with pytest.warns(CacheWarning, match="ignoring cache entry"):
        again = v1.fit(v1.verl_config(tmp_path, steps=(1,), total=1), v1.prompts(0))

    assert again.agent_loop.prompts == 4


def test_a_killed_dump_leaves_no_entry(tmp_path):
    """A trainer SIGKILLed while writing step 2's entry: step 1 replays, step 2 is generated."""
    done = subprocess.run(
        [sys.executable, str(HERE / "killed_dump.py"), str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == -9, done.stderr[-3000:]
    assert entries(tmp_path) == {".": [1]}

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        resumed = v1.fit(v1.verl_config(tmp_path, steps=(1, 2), total=2), v1.prompts(0))

    assert any("left by a dump that was killed" in str(w.message) for w in said)
    assert resumed.agent_loop.prompts == 4 and entries(tmp_path) == {".": [1, 2]}


def test_a_stored_trajectory_batch_comes_back_field_for_field(tmp_path):
    """Jagged tensors, dense tensors, per-row Python values and one-for-all values, through skip's store."""
    from skip_core.config import Namespace
    from skip_core.store import CacheStore
    from skip_plugin_verl.tensordicts import to_batch, to_tensordict
    from tensordict import NonTensorData, NonTensorStack, TensorDict
    from verl.utils.tensordict_utils import assert_tensordict_eq

    rows = [torch.arange(n) for n in (3, 1, 4)]
    data = TensorDict(
        {
            "responses": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
            "reward": torch.tensor([0.5, 1.0, 0.0]),
            "extra_fields": NonTensorStack({"turns": [1, 2]}, {"turns": []}, {"turns": [3]}),
            "agent_name": NonTensorData("tool_agent"),
        },
        batch_size=[3],
    )
    keys = ["a_0_0", "a_1_0", "b_0_0"]
    store = CacheStore(tmp_path, Namespace(), role="rollout_tq")
    store.save(1, to_batch(data, keys, [{"status": "success"}] * 3, ["p", "p", None]))

    back = to_tensordict(store.load(store.entry(1)), [0, 1, 2])

    assert_tensordict_eq(back, data)


def test_a_role_the_v1_trainer_never_calls_is_said_once(tmp_path):
    """``skip.rollout`` (the legacy trainer's) on verl's V1 trainer: accepted by verl's schema, never reached."""
    from omegaconf import open_dict

    config = v1.verl_config(tmp_path, steps=(1,), total=3)
    with open_dict(config):
        config.skip.rollout.update(enable=True, dump_dir=str(tmp_path), steps=[1, 2])

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        v1.fit(config, v1.prompts(0))

    told = [str(w.message) for w in said if "without calling what this role serves" in str(w.message)]
    assert told == [
        "skip.rollout: verl's trainer ended step 1 without calling what this role serves, so nothing is cached "
        "or replayed for it (verl's V1 trainer (trainer.use_v1=true, its default) caches rollouts with skip.rollout_tq)"
    ]
