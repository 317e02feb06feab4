"""The sglang backend. SGLang needs CUDA: on a machine without it, what must hold is that the
backend is installed and listed, and that choosing it fails before any work, in one line. The
engine tests run where CUDA and SGLang are present (the GPU check of the README)."""

import asyncio

import pytest
import torch
from click.testing import CliRunner
from skip_core.backend import SamplingParams, check_backend, create_backend, one_bucket
from skip_core.cli import cli
from skip_core.config import ConfigError
from skip_core.plugins import registry
from skip_core.sections import Sections, parse_sections
from skip_plugin_hf.config import HFConfig
from skiptests import CONFIGS, SMALL

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="SGLang needs a CUDA GPU; this machine has none")


def sections(**engine) -> Sections:
    return parse_sections({"rollout": {"engine_kwargs": {"sglang": engine}}}, registry().sections)


def test_skip_plugins_lists_the_backend():
    result = CliRunner().invoke(cli, ["plugins"])
    assert result.exit_code == 0 and "backend sglang" in result.output


@pytest.mark.skipif(GPU, reason="checks the refusal on a machine without CUDA")
def test_without_cuda_skip_rollout_fails_before_any_work_in_one_line(tmp_path):
    fresh = tmp_path / "never-built"
    args = ["rollout", "--config-dir", str(CONFIGS), *SMALL, f"task.dir={fresh}", "rollout.backend=sglang"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    assert "rollout.backend: 'sglang' needs a CUDA GPU, and torch finds none here" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not fresh.exists()


def test_a_bad_engine_option_is_named_with_the_closest_key():
    closest = r"; did you mean rollout\.engine_kwargs\.sglang\.mem_fraction_static\?$"
    with pytest.raises(ConfigError, match=r"^rollout\.engine_kwargs\.sglang\.mem_fraction: unknown key .*" + closest):
        sections(mem_fraction=0.4)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    pytest.importorskip("sglang", reason="SGLang is not installed: pip install 'skip-plugin-sglang[gpu]'")
    loop = asyncio.new_event_loop()
    sglang = create_backend("sglang", sections(dtype="float32"), tiny_model_dir)
    hf = create_backend("hf", Sections(HFConfig(device="cuda")), tiny_model_dir)
    yield loop.run_until_complete, sglang, hf
    loop.run_until_complete(sglang.shutdown())
    loop.run_until_complete(hf.shutdown())


@needs_gpu
def test_greedy_tokens_are_the_hf_backends_and_follow_new_weights(engines, tiny_model_dir):
    from safetensors.torch import load_file

    run, sglang, hf = engines
    prompt, params = list(range(3, 60)), SamplingParams(temperature=0.0, max_new_tokens=32)
    assert run(sglang.generate(prompt, params, "a"))[0].token_ids == run(hf.generate(prompt, params, "a"))[0].token_ids
    generator = torch.Generator().manual_seed(0)
    weights = load_file(tiny_model_dir / "model.safetensors")
    other = {k: w + w.std() * torch.randn(w.shape, generator=generator) for k, w in weights.items() if w.dim() > 1}
    run(sglang.update_weights(one_bucket(other)))
    run(hf.update_weights(one_bucket(other)))
    assert run(sglang.generate(prompt, params, "b"))[0].token_ids == run(hf.generate(prompt, params, "b"))[0].token_ids


@needs_gpu
def test_pause_returns_partial_output(engines):
    run, sglang, _ = engines

    async def interrupted():
        call = asyncio.ensure_future(sglang.generate(list(range(3, 60)), SamplingParams(max_new_tokens=2000), "p"))
        await asyncio.sleep(0.2)
        await sglang.pause()
        [partial] = await call
        await sglang.resume()
        return partial

    partial = run(interrupted())
    assert partial.finish_reason == "abort" and len(partial.log_probs) == len(partial.token_ids) < 2000


def test_on_a_ray_cluster_the_driver_leaves_the_device_check_to_the_workers(monkeypatch):
    """The driver of a cluster run may sit on a machine without a GPU while the workers have one;
    the options are still checked there."""
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    check_backend("sglang", sections(), registry().backends)
    with pytest.raises(ConfigError, match=r"^rollout\.engine_kwargs\.sglang\.tp_size: expected an integer > 0, got 0$"):
        sections(tp_size=0)
