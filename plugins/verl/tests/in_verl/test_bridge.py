"""verl 0.9.1's own ``SkipManager``, used as verl's trainers use it, served by skip once
skip-plugin-verl is installed: nothing here imports the bridge or patches verl by hand.

Calls go through verl's decorated methods (``AgentLoopManager.generate_sequences``,
``FullyAsyncAgentLoopManager.generate_sequences_single``); only verl's Ray agent-loop workers
are scripted (``conftest.ScriptedWorker``).
"""

from __future__ import annotations

import asyncio
import base64
import csv
import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import skip_core
from omegaconf import OmegaConf
from safetensors import safe_open
from skip_core.config import ConfigError
from skip_core.entries import verify
from skip_core.files import LOCK
from skip_core.store import CacheWarning
from verl.utils.skip import SkipManager

from conftest import SHAPE, plant_verl_dump, prompts, run_config, same

HERE = Path(__file__).resolve().parent
SKIP_FILES = {"meta.json", "data.json", "tensors.safetensors"}


def entry(dump_dir: Path, step: int, role: str = "rollout", experiment: str = "exp") -> Path:
    run = dump_dir / f"{experiment}_proj"
    return (run if role == "rollout" else run / role) / SHAPE / str(step)


def assert_data_only(directory: Path) -> None:
    """Every file under ``directory`` is skip's JSON or safetensors (beside the lock of the
    namespace this process dumps into, held until the run ends): no pickle was written."""
    files = [path for path in directory.rglob("*") if path.is_file() and path.name != LOCK]
    assert files
    for path in files:
        assert path.name in SKIP_FILES, path
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            with safe_open(str(path), "pt") as tensors:
                assert list(tensors.keys())


def step(config, number: int) -> None:
    SkipManager.init(config)
    SkipManager.set_step(number)


def test_installing_the_bridge_is_enough_and_verl_is_unmodified():
    """The manager every verl module imports is served by skip, and verl's files match its wheel's RECORD."""
    from importlib.metadata import distribution

    import verl.utils.skip.skip_manager as module

    assert SkipManager is module.SkipManager
    assert SkipManager.served_by == "skip-plugin-verl"
    record = distribution("verl").read_text("RECORD")
    site = Path(distribution("verl").locate_file(""))
    checked = 0
    for name, digest, _ in csv.reader(record.splitlines()):
        if name.startswith("verl/utils/skip/") and digest:
            algorithm, _, expected = digest.partition("=")
            actual = base64.urlsafe_b64encode(hashlib.new(algorithm, (site / name).read_bytes()).digest())
            assert actual.rstrip(b"=").decode() == expected, name
            checked += 1
    assert checked >= 5


def test_rollout_misses_then_hits_in_skip_format(tmp_path, rollout_manager, worker):
    dumps = tmp_path / "dumps"
    step(run_config(dumps), 1)

    generated = rollout_manager.generate_sequences(prompts())
    replayed = rollout_manager.generate_sequences(prompts())  # another uid, as verl draws them

    assert len(worker.batches) == 1
    assert type(replayed) is type(generated)
    assert same(replayed, generated)
    skip_core.SkipManager.flush()
    meta = verify(entry(dumps, 1), role="rollout")
    assert meta["samples"] == 2 and meta["fingerprint"]
    assert_data_only(dumps)


def test_a_new_run_replays_and_skip_cache_commands_read_the_entries(tmp_path, rollout_manager, worker):
    dumps = tmp_path / "dumps"
    step(run_config(dumps), 2)
    generated = rollout_manager.generate_sequences(prompts(seed=5))
    skip_core.SkipManager.flush()

    step(run_config(dumps), 2)  # what a restarted trainer does
    replayed = rollout_manager.generate_sequences(prompts(seed=5))

    assert len(worker.batches) == 1 and same(replayed, generated)
    skip = [str(Path(sys.executable).with_name("skip")), "cache"]
    listing = subprocess.run([*skip, "ls", str(dumps)], capture_output=True, text=True, check=True).stdout
    assert "rollout" in listing and "ok (sizes)" in listing
    verified = subprocess.run([*skip, "verify", str(dumps)], capture_output=True, text=True, check=True).stdout
    assert "all 1 entries verified" in verified
    pruned = subprocess.run([*skip, "prune", str(dumps)], capture_output=True, text=True, check=True).stdout
    assert "0 directories removed" in pruned


def test_other_prompts_at_a_cached_step_are_regenerated_when_asked(tmp_path, rollout_manager, worker):
    dumps = tmp_path / "dumps"
    step(run_config(dumps, on_prompt_mismatch="regenerate"), 1)
    rollout_manager.generate_sequences(prompts(seed=0))

    changed = rollout_manager.generate_sequences(prompts(seed=7))

    assert len(worker.batches) == 2
    assert changed.batch["prompts"][0, 0].item() == 7


def test_repeat_serves_the_nearest_dumped_step(tmp_path, rollout_manager, worker):
    dumps = tmp_path / "dumps"
    step(run_config(dumps, action="repeat"), 1)
    first = rollout_manager.generate_sequences(prompts(seed=1))

    SkipManager.set_step(3)
    repeated = rollout_manager.generate_sequences(prompts(seed=3))

    assert len(worker.batches) == 1 and same(repeated, first)
    skip_core.SkipManager.flush()
    assert not entry(dumps, 3).exists()


def test_validation_runs_and_leaves_the_cache_alone(tmp_path, rollout_manager, worker):
    dumps = tmp_path / "dumps"
    step(run_config(dumps), 1)
    rollout_manager.generate_sequences(prompts())
    skip_core.SkipManager.flush()
    before = {p: p.read_bytes() for p in entry(dumps, 1).iterdir()}

    rollout_manager.generate_sequences(prompts(seed=9, validate=True))
    SkipManager.set_step(2)
    rollout_manager.generate_sequences(prompts(seed=9, validate=True))
    skip_core.SkipManager.flush()

    assert len(worker.batches) == 3
    assert {p: p.read_bytes() for p in entry(dumps, 1).iterdir()} == before
    assert not entry(dumps, 2).exists()


def test_async_rollout_steps_are_the_feed_index_of_the_sample_id(tmp_path, async_manager, worker):
    dumps = tmp_path / "dumps"
    SkipManager.init(run_config(dumps, role="async_rollout", steps=[1]))

    generated = asyncio.run(async_manager.generate_sequences_single(prompts(uid="uid_sample_0_1", n=1)))
    replayed = asyncio.run(async_manager.generate_sequences_single(prompts(uid="uid_sample_0_1", n=1)))
    other = asyncio.run(async_manager.generate_sequences_single(prompts(seed=4, uid="uid_sample_0_2", n=1)))

    assert len(worker.batches) == 2 and same(replayed, generated) and not same(other, generated)
    skip_core.SkipManager.flush()
    assert verify(entry(dumps, 1, role="async_rollout"), role="async_rollout")["step"] == 1
    assert not entry(dumps, 2, role="async_rollout").exists()
    assert_data_only(dumps)


def test_a_truncated_entry_is_a_miss_with_a_warning(tmp_path, rollout_manager, worker):
    dumps = tmp_path / "dumps"
    step(run_config(dumps), 1)
    generated = rollout_manager.generate_sequences(prompts())
    skip_core.SkipManager.flush()
    tensors = entry(dumps, 1) / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:40])

    with pytest.warns(CacheWarning, match="tensors.safetensors has 40 bytes"):
        again = rollout_manager.generate_sequences(prompts())

    assert len(worker.batches) == 2 and same(again, generated)
    skip_core.SkipManager.flush()
    verify(entry(dumps, 1), role="rollout")  # the run's dump replaced the broken entry


def test_a_planted_pickle_is_never_executed_nor_deleted(tmp_path, rollout_manager, worker):
    dumps, marker = tmp_path / "dumps", tmp_path / "pwned"
    planted = plant_verl_dump(entry(dumps, 1), marker)
    pickle_bytes = (planted / "gen_batch.dp").read_bytes()

    with pytest.warns(UserWarning) as caught:
        step(run_config(dumps), 1)
        rollout_manager.generate_sequences(prompts())
        skip_core.SkipManager.flush()

    assert not marker.exists()
    assert len(worker.batches) == 1
    assert (planted / "gen_batch.dp").read_bytes() == pickle_bytes
    said = " | ".join(str(w.message) for w in caught)
    assert "1 verl dump(s) in" in said and "import-verl" in said and "--role rollout" in said
    assert "holds gen_batch.dp, which skip did not write" in said


def test_verl_async_rollout_dumps_are_pointed_at_with_the_role_to_import_them_as(tmp_path):
    dumps = tmp_path / "dumps"
    plant_verl_dump(entry(dumps, 7), tmp_path / "pwned")  # verl writes async_rollout dumps in this layout too

    with pytest.warns(UserWarning, match=r"skip\.async_rollout: 1 verl dump\(s\) in .* --role async_rollout"):
        SkipManager.init(run_config(dumps, role="async_rollout"))

    assert not (tmp_path / "pwned").exists()


def test_a_traversal_in_experiment_name_stays_inside_dump_dir(tmp_path, rollout_manager):
    dumps = tmp_path / "a" / "b" / "c" / "dumps"
    step(run_config(dumps, experiment="../../../escaped"), 1)

    rollout_manager.generate_sequences(prompts())
    skip_core.SkipManager.flush()

    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert written and all(path.is_relative_to(dumps) for path in written)
    assert not any("escaped" in path.name for path in tmp_path.iterdir())


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("steps", [1, "x"], r"skip\.rollout\.steps\[1\]: expected an integer"),
        ("action", "random", r"skip\.rollout\.action: expected 'cache' or 'repeat'"),
        ("stepz", [1], r"skip\.rollout\.stepz: unknown key \(allowed: action, dump_dir, enable"),
    ],
)
def test_skip_sections_are_validated_by_skip_naming_the_key(tmp_path, key, value, message):
    config = run_config(tmp_path)
    config.skip.rollout[key] = value

    with pytest.raises(ConfigError, match=message):
        SkipManager.init(config)


def test_an_enabled_role_no_plugin_provides_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"skip\.reward_model: no installed plugin provides role 'reward_model'"):
        SkipManager.init(run_config(tmp_path, role="reward_model"))


def test_a_role_rendered_from_plugin_template_is_a_role_verl_can_name(tmp_path):
    role = os.environ.get("SKIP_TEST_TEMPLATE_ROLE")
    if not role:
        pytest.skip("set SKIP_TEST_TEMPLATE_ROLE to a role rendered from plugin_template and installed here")
    runs = []

    class Scorer:
        @SkipManager.annotate(role=role)
        def compute(self, prompts):
            runs.append(prompts)
            return prompts

    dumps = tmp_path / "dumps"
    step(run_config(dumps, role=role), 1)
    first = Scorer().compute(prompts())
    again = Scorer().compute(prompts())

    assert len(runs) == 1 and same(again, first)
    skip_core.SkipManager.flush()
    assert verify(entry(dumps, 1, role=role), role=role)["role"] == role


def test_the_transfer_queue_role_is_skips(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SkipManager.init(run_config(tmp_path, role="rollout_tq"))

    assert SkipManager.skip_instances == {}
    assert list(skip_core.SkipManager.stores()) == ["rollout_tq"]


def test_a_verl_role_no_installed_plugin_provides_stays_verls_with_a_warning(tmp_path):
    """skip-plugin-rollout left out by ``SKIP_PLUGINS``: verl's own ``RolloutSkip`` serves ``skip.rollout``."""
    said = run_script("verl_role.py", str(tmp_path), env={"SKIP_PLUGINS": "skip-plugin-verl"})

    assert said["served_by"] == "skip-plugin-verl"
    assert said["instances"] == {"rollout": "RolloutSkip"} and said["stores"] == []
    assert said["warnings"] == [
        "skip.rollout: no installed skip plugin provides this verl role; verl's own code serves it "
        "(pickled dumps, loaded unverified)"
    ]


def test_the_legacy_rollout_skip_flag_is_turned_off_with_a_deprecation_warning(tmp_path):
    config = run_config(tmp_path)
    config.actor_rollout_ref.rollout.skip = {"enable": True}
    OmegaConf.set_readonly(config, True)

    with pytest.warns(DeprecationWarning, match="actor_rollout_ref.rollout.skip.enable is deprecated"):
        SkipManager.init(config)

    assert config.actor_rollout_ref.rollout.skip.enable is False


def test_the_legacy_flag_alone_is_left_alone(tmp_path):
    config = run_config(tmp_path, enable=False)
    config.actor_rollout_ref.rollout.skip = {"enable": True}

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        SkipManager.init(config)

    assert config.actor_rollout_ref.rollout.skip.enable is True


def run_script(*args: str, env: dict | None = None) -> dict:
    """``verl_failures.py`` (or another script here) in a fresh interpreter of this venv."""
    environment = {k: v for k, v in os.environ.items() if k not in ("SKIP_PLUGINS", "RAY_ADDRESS")}
    environment.update(env or {})
    done = subprocess.run(
        [sys.executable, *args], cwd=HERE, env=environment, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_three_verl_failures_become_a_miss_a_refusal_and_a_contained_path(tmp_path):
    """verl's own manager (bridge turned off with SKIP_PLUGINS) against the bridge, same script."""
    without_bridge = {"SKIP_PLUGINS": "skip-plugin-rollout,skip-plugin-async-rollout"}
    stock = run_script("verl_failures.py", str(tmp_path / "stock"), env=without_bridge)
    bridged = run_script("verl_failures.py", str(tmp_path / "bridged"))

    assert stock["served_by"] is None
    assert stock["truncated"].startswith("raised UnpicklingError") or stock["truncated"].startswith("raised EOFError")
    assert stock["planted_executed"] is True
    assert stock["escaped"]
    assert stock["formats"] == ["gen_batch.dp", "meta.json"]

    assert bridged["served_by"] == "skip-plugin-verl"
    assert bridged["truncated"] == "regenerated" and "has " in bridged["truncated_warning"]
    assert bridged["planted_executed"] is False and bridged["planted_kept"] is True
    assert bridged["escaped"] == []
    assert bridged["formats"] == ["data.json", "meta.json", "tensors.safetensors"]


def test_an_untested_verl_version_warns_once_and_keeps_verls_manager():
    said = run_script("untested_version.py")

    assert said["served_by"] is None
    assert len(said["warnings"]) == 1
    assert "verl 0.10.0 is not a version this bridge was tested with (0.9.1)" in said["warnings"][0]


def test_a_ray_worker_process_gets_the_bridge(tmp_path):
    said = run_script("ray_worker.py", str(tmp_path / "dumps"))

    assert said["driver_imported_verl"] is False
    assert said["served_by"] == "skip-plugin-verl"
    assert said["worker_pid"] != said["driver_pid"]
    assert said["runs"] == 1
    verify(entry(tmp_path / "dumps", 1), role="rollout")
