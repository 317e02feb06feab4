"""A cache from someone else, or from a careless hand, through the real store, manager and
``skip cache`` commands: it never hangs, never reads without end, never follows a link out of the
dump directory, never crashes a lookup; each bad entry is a warning naming it, then a miss."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from skip_core import Batch, SkipManager
from skip_core.caching import PromptMismatchError, SetupMismatchError, SetupMismatchWarning
from skip_core.cli import cli
from skip_core.config import RoleConfig, StepSet, parse_section
from skip_core.entries import META, seal
from skip_core.layout import Column, Layout
from skip_core.provenance import Setup, model_digest
from skip_core.reading import nesting
from skip_core.store import CacheStore, CacheWarning
from skiptests import NS, ROOT, make_prompts, run_config

LAYOUT = Layout({"responses": Column("int64", "response"), "rollout_log_probs": Column("float32", "response")})


class Rollout:
    """A rollout stand-in whose results fit ``LAYOUT`` (16 response columns, the config's length)."""

    def __init__(self) -> None:
        self.calls = 0

    @SkipManager.annotate(role="rollout", layout=LAYOUT)
    def generate_sequences(self, prompts: Batch) -> Batch:
        self.calls += 1
        responses = torch.cat([prompts.batch["input_ids"], prompts.batch["input_ids"]], dim=1) + self.calls
        return Batch.from_dict({"responses": responses, "rollout_log_probs": torch.rand(responses.shape)})


def config(tmp_path, temperature=1.0, **section):
    settings = run_config(tmp_path / "cache", **section)
    settings["actor_rollout_ref"]["rollout"]["temperature"] = temperature
    return settings


def filled(tmp_path, steps=(1, 2), **section) -> tuple[CacheStore, Rollout]:
    """A cache with the entries of ``steps``, written by the manager as a run writes them."""
    rollout = Rollout()
    SkipManager.init(config(tmp_path, **section))
    for step in steps:
        SkipManager.set_step(step)
        rollout.generate_sequences(make_prompts(seed=step))
    SkipManager.flush()
    return SkipManager.stores()["rollout"], rollout


def replay(tmp_path, step, temperature=1.0, **section) -> tuple[Rollout, list[str]]:
    """A new run's call at ``step``: the rollout (``calls`` 0 when replayed) and the warnings it gave."""
    rollout = Rollout()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SkipManager.init(config(tmp_path, temperature, **section))
        SkipManager.set_step(step)
        rollout.generate_sequences(make_prompts(seed=step))
        SkipManager.flush()
    return rollout, [str(w.message) for w in caught]


def reseal(entry, name) -> None:
    """Record ``name``'s new size and hash in meta.json, as someone covering a change would."""
    meta = json.loads((entry / META).read_text())
    meta["files"][name] = seal(entry / name)
    (entry / META).write_text(json.dumps(meta))


def cache_command(*args):
    return CliRunner().invoke(cli, ["cache", *map(str, args)], catch_exceptions=False)


# -- files that are not what they claim ------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_named_pipe_as_a_data_file_never_hangs_a_lookup_or_verify(tmp_path):
    store, _ = filled(tmp_path)
    data = store.path(1) / "tensors.safetensors"
    data.unlink()
    os.mkfifo(data)
    rollout, said = replay(tmp_path, 1)
    assert rollout.calls == 1  # refused, then generated: the dump replaced the pipe
    assert any(f"ignoring cache entry {store.path(1)}" in s and "named pipe" in s for s in said), said
    assert not store.path(1).joinpath("tensors.safetensors").is_fifo()
    os.unlink(data)
    os.mkfifo(data)
    result = cache_command("verify", tmp_path / "cache")
    assert result.exit_code == 1 and "tensors.safetensors is not a regular file" in result.output


def _link_to_dev_zero(entry) -> None:
    (entry / "tensors.safetensors").unlink()
    os.symlink("/dev/zero", entry / "tensors.safetensors")
    meta = json.loads((entry / META).read_text())
    meta["files"]["tensors.safetensors"] = {"bytes": 0, "xxh3_128": "99aa06d3014798d86001c324468d497f"}
    (entry / META).write_text(json.dumps(meta))


@pytest.mark.timeout(120)
def test_a_link_to_dev_zero_recorded_as_empty_is_refused_unread(tmp_path):
    store, _ = filled(tmp_path)
    _link_to_dev_zero(store.path(1))
    rollout, said = replay(tmp_path, 1)
    assert rollout.calls == 1 and any("is a symbolic link" in s for s in said), said
    _link_to_dev_zero(store.path(1))
    result = cache_command("verify", tmp_path / "cache")
    assert result.exit_code == 1 and "tensors.safetensors is a symbolic link" in result.output


def test_a_link_to_a_file_outside_the_dump_directory_is_never_followed(tmp_path):
    store, _ = filled(tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(store.path(1) / "tensors.safetensors", outside)
    os.symlink(outside, store.path(1) / "tensors.safetensors")
    rollout, said = replay(tmp_path, 1)
    assert rollout.calls == 1 and any("tensors.safetensors is a symbolic link" in s for s in said), said


def test_a_step_directory_that_is_a_link_says_so_and_a_dump_never_lists_what_it_points_to(tmp_path):
    store, _ = filled(tmp_path, steps=(2,))
    secret = tmp_path / "private"
    secret.mkdir()
    (secret / "id_rsa_of_someone").write_text("x")
    os.symlink(secret, store.path(1))
    rollout, said = replay(tmp_path, 1)
    assert rollout.calls == 1
    assert any("step directory is a symbolic link" in s for s in said), said
    (refused,) = [s for s in said if "dump failed" in s]
    assert str(store.path(1)) in refused and "is not a directory skip wrote" in refused
    assert "id_rsa" not in " ".join(said)
    assert os.path.islink(store.path(1)) and os.listdir(secret) == ["id_rsa_of_someone"]
    listing = cache_command("ls", tmp_path / "cache")
    assert listing.exit_code == 0 and "symbolic link" in listing.output


def test_nested_meta_json_is_a_corrupt_entry_not_a_recursion_error(tmp_path):
    store, _ = filled(tmp_path)
    (store.path(1) / META).write_text("[" * 100_000 + "]" * 100_000)
    rollout, said = replay(tmp_path, 1)
    assert rollout.calls == 1 and any("nested 100000 levels deep" in s for s in said), said
    (store.path(2) / META).write_text("[" * 100_000 + "]" * 100_000)
    listing = cache_command("ls", tmp_path / "cache")
    assert listing.exit_code == 0 and listing.output.count("corrupt: meta.json: nested 100000 levels deep") == 1


def test_nested_data_json_resealed_is_refused_at_load_and_generated_again(tmp_path):
    store, _ = filled(tmp_path)
    payload = json.loads((store.path(1) / "data.json").read_text())
    payload["meta_info"] = {"x": json.loads("[" * 500 + "]" * 500)}
    (store.path(1) / "data.json").write_text(json.dumps(payload))
    reseal(store.path(1), "data.json")
    rollout, said = replay(tmp_path, 1)
    assert rollout.calls == 1 and any("levels deep" in s and "running it instead" in s for s in said), said
    assert replay(tmp_path, 1)[0].calls == 0  # the entry the call dumped replaced it


# -- entries that verify but do not fit --------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "mismatch"),
    [
        (lambda t: t.update(responses=t["responses"].float()), "responses is float32, expected int64"),
        (lambda t: t.update(rollout_log_probs=t["rollout_log_probs"][:, :-1].contiguous()), "has 15 columns"),
        (lambda t: t.update(responses=t["responses"][:-1].contiguous()), "responses has 3 rows, expected 4"),
        (lambda t: t.pop("rollout_log_probs"), "lacks the tensor 'rollout_log_probs'"),
    ],
)
def test_a_resealed_entry_that_does_not_fit_the_step_is_refused_and_generated_again(tmp_path, change, mismatch):
    store, _ = filled(tmp_path)
    tensors = {k: v.clone() for k, v in load_file(store.path(1) / "tensors.safetensors").items()}
    change(tensors)
    save_file(tensors, store.path(1) / "tensors.safetensors")
    reseal(store.path(1), "tensors.safetensors")
    rollout, said = replay(tmp_path, 1)
    assert rollout.calls == 1
    (warning,) = [s for s in said if "does not fit" in s]
    assert str(store.path(1)) in warning and mismatch in warning
    assert replay(tmp_path, 1)[0].calls == 0


# -- replays under another setup --------------------------------------------------------------


def test_a_changed_temperature_warns_once_naming_the_key_and_replays(tmp_path):
    filled(tmp_path, steps=(1, 2))
    rollout = Rollout()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SkipManager.init(config(tmp_path, temperature=0.3))
        for step in (1, 2):
            SkipManager.set_step(step)
            rollout.generate_sequences(make_prompts(seed=step))
    assert rollout.calls == 0
    (warning,) = [w for w in caught if issubclass(w.category, SetupMismatchWarning)]
    assert "rollout.temperature (1.0 there, 0.3 here)" in str(warning.message)
    assert "skip.rollout.on_setup_mismatch=warn" in str(warning.message)


def test_a_changed_temperature_regenerates_or_stops_as_the_policy_says(tmp_path):
    store, _ = filled(tmp_path, steps=(1,))
    with pytest.raises(SetupMismatchError, match=r"rollout\.temperature \(1\.0 there, 0\.3 here\)"):
        replay(tmp_path, 1, temperature=0.3, on_setup_mismatch="error")
    rollout, said = replay(tmp_path, 1, temperature=0.3, on_setup_mismatch="regenerate")
    assert rollout.calls == 1 and not any("setup" in s for s in said)
    assert json.loads((store.path(1) / META).read_text())["setup"]["rollout.temperature"] == 0.3
    assert replay(tmp_path, 1, temperature=0.3, on_setup_mismatch="error")[0].calls == 0


def test_the_model_is_named_by_its_files_not_its_path(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, model / "model.safetensors")
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert model_digest(copy) == model_digest(model)
    save_file({"w": torch.arange(4096, dtype=torch.float32) * 2}, copy / "model.safetensors")
    assert model_digest(copy) != model_digest(model)
    with_config = run_config(tmp_path / "cache")
    with_config["actor_rollout_ref"]["model"] = {"path": str(model)}
    SkipManager.init(with_config)
    SkipManager.set_step(1)
    Rollout().generate_sequences(make_prompts(seed=1))
    SkipManager.flush()
    with_config["actor_rollout_ref"]["model"] = {"path": str(copy)}
    SkipManager.init(with_config)
    with pytest.warns(SetupMismatchWarning, match=r"generated under another setup: model\.path \("):
        assert SkipManager.would_replace("rollout", 1, make_prompts(seed=1))


def test_prompt_mismatch_error_stops_a_run_before_it_starts(tmp_path):
    filled(tmp_path, steps=(1,))
    SkipManager.init(config(tmp_path, on_prompt_mismatch="error"))
    with pytest.raises(PromptMismatchError, match="different inputs"):
        SkipManager.would_replace("rollout", 1, make_prompts(seed=9))


# -- shared, interrupted and oversized ----------------------------------------------------------

READ_ONLY_REPLAY = """
import json, sys, warnings
sys.path[:0] = [{tests!r}, {shared!r}]
from test_hostile import Rollout, config
from skip_core import SkipManager
from skiptests import make_prompts
from pathlib import Path
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    SkipManager.init(config(Path({tmp!r})))
    rollout = Rollout()
    for step in (1, 2, 3):
        SkipManager.set_step(step)
        rollout.generate_sequences(make_prompts(seed=step))
    SkipManager.flush()
print(json.dumps({{"calls": rollout.calls, "said": [str(w.message) for w in caught]}}))
"""


def _read_only(tmp_path, command: list[str]) -> subprocess.CompletedProcess:
    """``command`` with ``tmp_path/cache`` mounted read-only (root writes through any mode bits)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False).returncode:
        pytest.skip("unshare --mount is refused here")
    cache = tmp_path / "cache"
    script = f'mount --bind -o ro {cache} {cache} && exec "$@"'
    return subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", *command], capture_output=True, text=True)


def test_a_read_only_cache_replays_and_says_once_that_nothing_is_dumped(tmp_path):
    filled(tmp_path, steps=(1, 2))
    SkipManager.reset()  # the run that wrote it is over, and its lock gone with it
    code = READ_ONLY_REPLAY.format(tests=os.path.dirname(__file__), shared=str(ROOT / "tests"), tmp=str(tmp_path))
    done = _read_only(tmp_path, [sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["calls"] == 1  # steps 1 and 2 replayed, step 3 generated
    (said,) = result["said"]
    assert "cannot be written" in said and "nothing new is dumped" in said
    assert sorted(os.listdir(_namespace_directory(tmp_path))) == ["1", "2"]


def _namespace_directory(tmp_path):
    return CacheStore(tmp_path / "cache", NS, "rollout").directory


def test_prune_reports_what_it_could_not_remove(tmp_path):
    store, _ = filled(tmp_path, steps=(1, 2))
    (store.path(2) / "data.json").write_text("{}")
    command = [sys.executable, "-m", "skip_core", "cache", "prune", str(tmp_path / "cache")]
    done = _read_only(tmp_path, command)
    assert done.returncode == 1
    assert f"could not remove {store.path(2)}" in done.stdout and "Read-only file system" in done.stdout
    assert "0 directories removed, 1 directory could not be" in done.stdout and "removed /" not in done.stdout


def test_leftovers_of_killed_dumps_are_removed_when_no_live_process_owns_them(tmp_path):
    store, _ = filled(tmp_path, steps=(1,))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    dead = store.directory / f".tmp-2-{gone.stdout.strip()}@{host}-abc"
    alive = store.directory / f".tmp-3-{os.getpid()}@{host}-def"
    unmarked = store.directory / ".tmp-4-ghi"
    for leftover in (dead, alive, unmarked):
        leftover.mkdir()
    with pytest.warns(CacheWarning, match=f"removed {dead}, left by a dump that was killed"):
        SkipManager.init(config(tmp_path))
    assert not dead.exists() and alive.exists() and unmarked.exists()


def test_steps_are_ranges_a_typo_costs_nothing():
    def rollout(steps, enable=True):
        return {"rollout": parse_section(RoleConfig, "skip.rollout", {"enable": enable, "steps": steps})}

    steps = rollout(["1..1000000000000", 5])["rollout"].steps
    assert steps == StepSet([(1, 10**12)]) and 10**12 in steps and 10**12 + 1 not in steps
    assert str(steps.above(20)) == "21..1000000000000"
    assert SkipManager.unreachable(rollout("1..1000000000000"), 20) == {"rollout": StepSet([(21, 10**12)])}
    assert SkipManager.unreachable(rollout("1..1000000000000", enable=False), 20) == {}
    every = rollout(["5..", 2])["rollout"].steps
    assert 2 in every and 3 not in every and 10**15 in every and str(every) == "2, 5.."
    assert SkipManager.unreachable(rollout(["5..", 2]), 20) == {}  # an open range is every step: never a typo


# -- the reader's bound on nesting ------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab,:'),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='[]{}"\\a'), inner, max_size=3),
    max_leaves=30,
)


def _depth(value) -> int:
    if isinstance(value, (list, dict)):
        children = value.values() if isinstance(value, dict) else value
        return 1 + max((_depth(child) for child in children), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_nesting_counts_brackets_outside_strings_only(value):
    assert nesting(json.dumps(value).encode()) == _depth(value)


def test_a_plugin_declaring_another_plugins_section_is_one_line_naming_both(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "skip_plugin_rogue.py").write_text(
        textwrap.dedent(
            """
            from pydantic import BaseModel
            from skip_core import hookimpl

            class Mine(BaseModel):
                enable: bool = False

            @hookimpl
            def skip_register_sections(register):
                register("profiling", Mine)
            """
        )
    )
    info = site / "skip_plugin_rogue-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: skip-plugin-rogue\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[skip]\nskip_plugin_rogue = skip_plugin_rogue\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "skip_core", "plugins"], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert "section 'profiling' is registered by both skip-plugin-" in line and "choose one" in line
    assert {"skip-plugin-profiling", "skip-plugin-rogue"} <= set(line.replace(",", " ").replace(";", " ").split())
    chosen = line.split("SKIP_PLUGINS=")[1].split()[0].split(",")
    assert len({"skip-plugin-profiling", "skip-plugin-rogue"} & set(chosen)) == 1
    assert "skip-plugin-rogue" in done.stdout  # the table still lists every plugin


def test_a_setup_whose_files_cannot_be_read_is_named_never_raised(tmp_path):
    """The setup is read from the user's model directory and tools file: a nested tokenizer
    config or a tools file in a package that is not installed must not break a lookup."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    turns = {"tools_config": "pkg://not_an_installed_package/tools.yaml"}
    values = Setup({"multi_turn": turns}, {"path": str(model)}).values
    assert values["model.chat_template"] is None
    assert values["rollout.multi_turn.tools_config"] == "path:pkg://not_an_installed_package/tools.yaml"
