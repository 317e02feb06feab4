"""The sglang backend's own checks: its options, the engine arguments they make, where the driver
refuses it, and the CPU stand-in's seeded-sampling hash. The contract every backend keeps runs
against SGLang's real engine in tests/test_backend_contract.py (on CPU through tests/sglang_cpu)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from skip_core.backend import check_backend
from skip_core.cli import cli
from skip_core.config import ConfigError
from skip_core.plugins import registry
from skip_core.sections import Sections, parse_sections
from skip_plugin_sglang.options import CPU_KV_TOKENS, SGLangOptions
from skiptests import CONFIGS, SMALL

pytestmark = pytest.mark.integration  # an SGLang engine on CPU

CUDA = torch.cuda.is_available()


def sections(**engine) -> Sections:
    return parse_sections({"rollout": {"engine_kwargs": {"sglang": engine}}}, registry().sections)


def test_skip_plugins_lists_the_backend():
    result = CliRunner().invoke(cli, ["plugins"])
    assert result.exit_code == 0 and "backend sglang" in result.output


def test_a_bad_engine_option_is_named_with_the_closest_key():
    closest = r"; did you mean rollout\.engine_kwargs\.sglang\.mem_fraction_static\?$"
    with pytest.raises(ConfigError, match=r"^rollout\.engine_kwargs\.sglang\.mem_fraction: unknown key .*" + closest):
        sections(mem_fraction=0.4)


def test_sglangs_other_server_arguments_go_to_the_engine_as_given():
    pytest.importorskip("sglang", reason="SGLang is not installed")
    options = SGLangOptions(chunked_prefill_size=1024)
    assert options.engine_arguments == {"chunked_prefill_size": 1024}
    assert options.engine_args(Path("/m"), cpu=True)["chunked_prefill_size"] == 1024


def test_on_cpu_the_engine_takes_sglangs_cpu_path_with_a_bounded_kv_cache():
    cpu = SGLangOptions().engine_args(Path("/m"), cpu=True)
    assert cpu["device"] == "cpu" and cpu["attention_backend"] == "torch_native"
    assert cpu["max_total_tokens"] == CPU_KV_TOKENS and not cpu["enable_memory_saver"] and cpu["disable_cuda_graph"]
    assert cpu["enable_deterministic_inference"], "SGLang ignores per-request seeds without it"
    assert SGLangOptions(max_total_tokens=4096).engine_args(Path("/m"), cpu=True)["max_total_tokens"] == 4096
    gpu = SGLangOptions().engine_args(Path("/m"), cpu=False)
    assert "device" not in gpu and "attention_backend" not in gpu and "max_total_tokens" not in gpu
    assert gpu["enable_memory_saver"] and gpu["enable_deterministic_inference"] and gpu["model_path"] == "/m"


def test_arguments_sglang_refuses_are_one_line_naming_the_section(tiny_model_dir):
    pytest.importorskip("sglang", reason="SGLang is not installed")
    from skip_core.backend import create_backend

    refused = r"^rollout\.engine_kwargs\.sglang: SGLang refused the engine's arguments: .*'no-such-backend'"
    with pytest.raises(ConfigError, match=refused):
        create_backend("sglang", sections(attention_backend="no-such-backend"), tiny_model_dir)


def _without(monkeypatch, module: str) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))


def test_where_sglang_is_not_installed_skip_rollout_fails_before_any_work_in_one_line(tmp_path, monkeypatch):
    _without(monkeypatch, "sglang")
    fresh = tmp_path / "never-built"
    args = ["rollout", "--config-dir", str(CONFIGS), *SMALL, f"task.dir={fresh}", "rollout.backend=sglang"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    assert "rollout.backend: 'sglang' needs SGLang, which is not installed here" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not fresh.exists()


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_on_a_cpu_without_sglangs_cpu_kernels_the_driver_says_so(monkeypatch):
    _without(monkeypatch, "sgl_kernel")
    with pytest.raises(ConfigError, match=r"^rollout\.backend: 'sglang' on a machine without CUDA needs .*sgl_kernel"):
        check_backend("sglang", sections(), registry().backends)


def test_on_a_ray_cluster_the_driver_leaves_the_machine_check_to_the_workers(monkeypatch):
    """The driver of a cluster run may sit on a machine without SGLang while the workers have it;
    the options are still checked there."""
    _without(monkeypatch, "sglang")
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    check_backend("sglang", sections(), registry().backends)
    with pytest.raises(ConfigError, match=r"^rollout\.engine_kwargs\.sglang\.tp_size: expected an integer > 0, got 0$"):
        sections(tp_size=0)


def _murmur3_x86_32(data: bytes) -> int:
    """MurmurHash3 x86 32-bit with seed 0, from its published definition."""
    h = 0
    for i in range(0, len(data), 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * 0xCC9E2D51) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        k = (k * 0x1B873593) & 0xFFFFFFFF
        h ^= k
        h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
        h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= len(data)
    for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):
        h ^= h >> shift
        if multiplier:
            h = (h * multiplier) & 0xFFFFFFFF
    return h


@pytest.mark.skipif(CUDA, reason="the CPU stand-in (tests/sglang_cpu) is on the path only where CUDA is not")
def test_the_cpu_stand_ins_seeded_sampling_hash_is_murmur3_of_seed_position_and_column():
    """SGLang's seeded sampler draws the noise of (seed, position, column) from MurmurHash3 of
    those 16 bytes; the stand-in computes it in int64 arithmetic, seeds above 2**63 included."""
    import sgl_kernel  # noqa: F401  # the stand-in registers the op

    seeds = torch.tensor([0, 7, 2**64 - 3, 2**63 + 5], dtype=torch.uint64)
    positions = torch.tensor([0, 1, 12345, 2**31], dtype=torch.int64)
    columns = torch.tensor([0, 3, 511, 2**32 - 1], dtype=torch.int64)
    hashed = torch.ops.sgl_kernel.murmur_hash32_cpu.default(seeds, positions, columns)
    assert hashed.dtype == torch.uint32 and hashed.shape == (4, 4)
    for row, (seed, position) in enumerate(zip([0, 7, 2**64 - 3, 2**63 + 5], positions.tolist(), strict=True)):
        for column, col in enumerate(columns.tolist()):
            key = seed.to_bytes(8, "little") + position.to_bytes(4, "little") + col.to_bytes(4, "little")
            assert int(hashed[row, column].to(torch.int64)) == _murmur3_x86_32(key)
