"""The vllm backend's own checks: its options, and the driver's refusal where vLLM is missing. The
contract every backend keeps (greedy tokens, seeds, log-probs, weight updates, pause, abort,
shutdown) runs against the real engine in tests/test_backend_contract.py."""

from __future__ import annotations

import pytest
from skip_core.backend import check_backend
from skip_core.config import ConfigError
from skip_core.plugins import registry
from skip_core.sections import Sections, parse_sections
from skip_plugin_vllm.options import VLLMOptions

pytestmark = pytest.mark.integration  # a vLLM engine on CPU


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"bogus": 1}, r"rollout\.engine_kwargs\.vllm\.bogus"),
        ({"dtype": "int3"}, r"rollout\.engine_kwargs\.vllm\.dtype"),
        ({"gpu_memory_utilization": 1.5}, r"rollout\.engine_kwargs\.vllm\.gpu_memory_utilization"),
    ],
)
def test_bad_engine_options_fail_at_start_naming_the_key(engine, message):
    config = {"rollout": {"engine_kwargs": {"vllm": engine}}}
    with pytest.raises(ConfigError, match=message):
        parse_sections(config, {"rollout.engine_kwargs.vllm": registry().sections["rollout.engine_kwargs.vllm"]})


def test_vllms_other_engine_arguments_go_to_the_engine_as_given(tmp_path):
    options = VLLMOptions(compilation_config={"level": 0}, max_num_batched_tokens=4096)
    assert options.engine_arguments == {"compilation_config": {"level": 0}, "max_num_batched_tokens": 4096}
    args = options.engine_args(tmp_path, sleep_mode=False, cpu=True)
    assert args["compilation_config"] == {"level": 0} and args["max_num_batched_tokens"] == 4096


def test_the_driver_refuses_the_backend_where_vllm_is_not_installed(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^rollout\.backend: 'vllm' needs vLLM, .*skip-plugin-vllm\[cpu\]"):
        check_backend("vllm", Sections(VLLMOptions()), registry().backends)
