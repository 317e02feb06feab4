"""verl's own launch scripts under ``skip run --check``: the override lists of tests/verl_corpus,
written out from verl's examples, with only the model, data and output paths swapped for the
session's embedded default. Each either validates (its values landing where skip reads them) or
stops in one line naming a key skip does not implement, as its ``# skip:`` line says."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from skip_core.cli import cli
from skip_plugin_trainer.config.verl_keys import alias
from skiptests import ROOT

CORPUS = ROOT / "tests" / "verl_corpus"
SCRIPTS = sorted(CORPUS.glob("*.txt"))
# verl picks the schedule by its entry module; skip by trainer.schedule.
SCHEDULES = {
    "verl.trainer.main_ppo": "sync",
    "verl.trainer.main_ppo_sync": "sync",  # the older name of main_ppo some of its examples still call
    "recipe.gvpo.gvpo_main_ppo": "sync",
    "recipe.dapo.main_dapo": "sync",
    "verl.experimental.one_step_off_policy.main_ppo": "one_step_off",
    "verl.experimental.fully_async_policy.fully_async_main": "fully_async",
}


def parse(path: Path) -> tuple[dict[str, str], list[str]]:
    header, overrides = {}, []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            key, _, value = line[1:].partition(":")
            header[key.strip()] = value.strip()
        elif line.strip():
            overrides.append(line)
    return header, overrides


@pytest.fixture(scope="module")
def paths(task_dir, tmp_path_factory):
    """The embedded default's model and tools; its data repeated to the size verl's scripts ask
    (a train batch of up to 1536 prompts)."""
    import pyarrow as pa

    out = tmp_path_factory.mktemp("corpus")
    train = pq.read_table(task_dir / "data" / "train.parquet")
    pq.write_table(pa.concat_tables([train] * (2048 // len(train) + 1)), out / "train.parquet")
    # The scripts' models have the positions their lengths need (DAPO's 20k-token responses);
    # the embedded model's RoPE takes any number, so only its config's limit is raised.
    model = out / "model"
    model.mkdir()
    for file in (task_dir / "model").iterdir():
        (model / file.name).symlink_to(file)
    config = json.loads((task_dir / "model" / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 131072}))
    return {
        "MODEL": str(model),
        "TRAIN": str(out / "train.parquet"),
        "VAL": str(task_dir / "data" / "val.parquet"),
        "TOOLS": "pkg://skip_plugin_arithmetic/calculator.yaml",
        "OUT": str(out / "run"),
        "USER_CODE": str(CORPUS / "stand_ins.py"),
    }


def substituted(overrides: list[str], paths: dict[str, str]) -> list[str]:
    pattern = re.compile(r"\$(MODEL|TRAIN|VAL|TOOLS|OUT|USER_CODE)\b")
    return [pattern.sub(lambda m: paths[m.group(1)], line) for line in overrides]


def test_the_corpus_covers_verls_workflows():
    workflows = {parse(path)[0]["workflow"] for path in SCRIPTS}
    wanted = {"grpo", "ppo", "rloo", "dapo", "multi_turn", "one_step_off", "fully_async", "lora", "rollout_correction"}
    assert wanted <= workflows


@pytest.mark.parametrize("script", SCRIPTS, ids=[path.stem for path in SCRIPTS])
def test_a_verl_launch_script_validates_or_names_the_key_skip_lacks(script, paths, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    header, overrides = parse(script)
    entry = header["entry"].split()[0]
    args = ["run", "--check", f"trainer.schedule={SCHEDULES[entry]}", *substituted(overrides, paths)]
    result = CliRunner().invoke(cli, args)
    expected = header["skip"]
    if expected == "runs" and "actor_rollout_ref.rollout.name=sglang" in overrides and not _sglang():
        expected = "actor_rollout_ref.rollout.name (skip's rollout.backend): 'sglang' needs SGLang"
    command = shlex.join(["skip", *args])
    if expected == "runs":
        assert result.exit_code == 0, f"{command}\n{result.output}"
        printed = yaml.safe_load("\n".join(line for line in result.output.splitlines() if not line.startswith("#")))
        assert not list(misplaced(substituted(overrides, paths), printed))
        return
    assert result.exit_code == 1, f"{command}\n{result.output}"
    lines = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1 and lines[0].startswith(f"Error: {expected}"), result.output


# Keys a launch script sets that skip maps to another value on purpose (fully-async's 0).
MAPPED = {"data.train_batch_size"}


def misplaced(overrides: list[str], printed: dict) -> list[str]:
    """The overrides whose scalar value is not what the printed settings hold at skip's path."""
    for override in overrides:
        key, _, text = override.lstrip("+").partition("=")
        path = alias(key)
        node = printed
        for part in path.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        value = yaml.safe_load(text)
        if isinstance(node, float) and isinstance(value, str):  # YAML 1.1 reads 1e-6 as text; Hydra as a float
            value = float(value)
        if node is KeyError or path in MAPPED or isinstance(value, (list, dict)) or isinstance(node, (list, dict)):
            continue
        if value != node and not (isinstance(node, str) and str(value) == node):
            yield f"{override}: skip's {path} is {node!r}"


def _sglang() -> bool:
    """SGLang is there (on CPU with its stand-in kernels, tests/sglang_cpu)."""
    import importlib.util

    return importlib.util.find_spec("sglang") is not None
