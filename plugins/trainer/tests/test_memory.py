"""``skip run --check``'s memory estimate: the shape it reads, what each setting changes, and the
estimate against the peak measured in a fresh process (docs/gpus.md states the same numbers)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from skip_core.cli import cli
from skip_plugin_trainer.config.algorithm import FsdpConfig
from skip_plugin_trainer.memory import GIB, Plan, Shape, estimate, parked, resident

QWEN2_05B = {
    "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
}  # fmt: skip
TOLERANCE = 0.25  # docs/gpus.md's: the estimate within 25% of the measured peak


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("qwen2", {}),
        ("qwen3", {"head_dim": 48, "tie_word_embeddings": False}),
        ("llama", {"attention_bias": True}),
        ("mistral", {}),
    ],
)
def test_the_shape_counts_the_parameters_transformers_builds(tmp_path, kind, extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    small = {"vocab_size": 1000, "hidden_size": 128, "intermediate_size": 300, "num_hidden_layers": 2}
    config = AutoConfig.for_model(kind, num_attention_heads=4, num_key_value_heads=2, **small, **extra)
    model = AutoModelForCausalLM.from_config(config)
    model.config.save_pretrained(tmp_path)
    assert Shape.read(tmp_path).params == sum(p.numel() for p in model.parameters())


def test_the_embedded_model_is_counted_whole(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert Shape.read(tiny_model_dir).params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2': the estimate knows llama, qwen2"),
        ({"model_type": "qwen2", **QWEN2_05B, "hidden_size": "896"}, "hidden_size is '896', not a positive integer"),
        ([1, 2], "config.json is not an object"),
    ],
)
def test_a_config_the_estimate_cannot_read_is_named(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        Shape.read(tmp_path)


def plan(**changes) -> Plan:
    settings = {
        "ranks": 8, "master": "float32", "compute": "bfloat16", "trainable": True, "reference": False,
        "checkpointing": True, "tokens": 8192, "responses": 6144, "chunk": None, "entropy": False,
    }  # fmt: skip
    return Plan(**{**settings, **changes})


def test_each_setting_moves_the_part_it_should():
    shape = Shape(152064, 3584, 28, 18944, 28, 4, 128, False, True, False, False)  # Qwen2.5-7B
    base = estimate(shape, plan())
    assert shape.params == 7_615_616_512  # Qwen2.5-7B's count
    assert estimate(shape, plan(ranks=4))["weights"] == 2 * base["weights"]
    assert estimate(shape, plan(checkpointing=False))["activations"] > 8 * base["activations"]
    assert estimate(shape, plan(compute="float32"))["activations"] > 1.5 * base["activations"]
    assert estimate(shape, plan(chunk=2048))["logits"] < base["logits"]
    assert estimate(shape, plan(reference=True))["reference"] == base["weights"] / 2  # bfloat16
    assert estimate(shape, plan(trainable=False))["AdamW"] == 0
    assert estimate(shape, plan(teacher=shape.params))["teacher"] == base["weights"] / 2  # bfloat16, sharded
    assert 25 * GIB < sum(base.values()) < 45 * GIB  # verl's FSDP engine needs about 32 GB here (issue 51)


def test_check_prints_the_estimate_per_rank(task_dir):
    result = CliRunner().invoke(
        cli, ["run", "--check", f"task.dir={task_dir}", "resources.actor.workers=2", "actor.fsdp_config.dtype=bf16"]
    )
    assert result.exit_code == 0, result.output
    assert "# peak memory per CPU rank in an update, estimated before anything loads" in result.output
    assert "#   actor: 2 ranks, bfloat16 compute over float32 weights, checkpointing on" in result.output
    assert yaml.safe_load(result.output)["actor"]["fsdp_config"]["dtype"] == "bfloat16"  # still one YAML document


def test_a_teacher_waits_on_the_host_where_the_reference_does():
    shape = Shape(152064, 3584, 28, 18944, 28, 4, 128, False, True, False, False)
    fsdp = FsdpConfig()
    for offload, colocated, kept in [(False, False, True), (True, False, False), (False, True, False)]:
        waiting = parked(fsdp, offload, colocated)
        alone, held = plan(reference=True, parked=waiting), plan(reference=True, teacher=shape.params, parked=waiting)
        parts = estimate(shape, held)
        assert parts["teacher"] == parts["reference"] > 0
        assert resident(parts, held) - resident(estimate(shape, alone), alone) == (parts["teacher"] if kept else 0)


def test_check_counts_the_teacher_and_names_a_teacher_it_cannot_read(task_dir, tmp_path):
    distilling = [
        f"task.dir={task_dir}", "distillation.enabled=true",
        f"+distillation.teacher_models.teacher.model_path={task_dir / 'model'}",
    ]  # fmt: skip
    student = CliRunner().invoke(cli, ["run", "--check", f"task.dir={task_dir}"])
    result = CliRunner().invoke(cli, ["run", "--check", *distilling])
    assert result.exit_code == 0, result.output
    assert " teacher " not in student.output
    # the teacher is the student's own weights here: its part is the reference's, in the compute dtype
    line = next(line for line in result.output.splitlines() if line.startswith("#   actor: weights"))
    parts = dict(part.split() for part in line.split(" = ")[0].removeprefix("#   actor: ").split(" · "))
    assert float(parts["teacher"]) == pytest.approx(float(parts["weights"]), rel=0.01)  # float32 on the CPU
    for name in os.listdir(task_dir / "model"):  # the student's tokenizer, in a model the estimate does not know
        if not name.endswith(".safetensors"):
            shutil.copy(task_dir / "model" / name, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    unknown = f"+distillation.teacher_models.teacher.model_path={tmp_path}"
    result = CliRunner().invoke(cli, ["run", "--check", *distilling[:2], unknown])
    assert result.exit_code == 0, result.output
    assert "# memory per CPU rank: not estimated: the teacher's model_type 'gpt2': the estimate knows" in result.output


@pytest.mark.integration
@pytest.mark.parametrize(
    ("shape", "rows", "dtype", "checkpointing"),
    [
        ({"num_hidden_layers": 2}, 2, "float32", False),  # the vocabulary's parts dominate
        ({"num_hidden_layers": 8, "vocab_size": 8192}, 4, "float32", False),  # the layers' activations do
        ({"num_hidden_layers": 8, "vocab_size": 8192}, 4, "float32", True),  # bfloat16 on this CPU: docs/gpus.md
    ],
)
def test_the_estimate_is_within_a_quarter_of_the_measured_peak(tmp_path, shape, rows, dtype, checkpointing):
    options = {
        "shape": {**QWEN2_05B, **shape}, "model": str(tmp_path / "model"), "rows": rows, "prompt": 128,
        "response": 128, "dtype": dtype, "checkpointing": checkpointing,
    }  # fmt: skip
    probe = Path(__file__).with_name("memory_probe.py")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(4 << 20)}  # freed blocks go back: the peak is what lived
    done = subprocess.run(
        [sys.executable, str(probe), json.dumps(options)], env=env, capture_output=True, text=True, check=True
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert abs(measured["estimate"] / measured["peak"] - 1) <= TOLERANCE, measured
