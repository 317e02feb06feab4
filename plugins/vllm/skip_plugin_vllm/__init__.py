"""Rollout backend ``vllm``: vLLM's async engine in each rollout worker.

Select it with ``rollout.backend=vllm``; engine options are the section ``rollout.engine_kwargs.vllm``
(see the README). vLLM is imported only when the backend is built: ``skip plugins`` and the
driver's check do not pay for it.
"""

from collections.abc import Mapping
from pathlib import Path

from skip_core import hookimpl
from skip_core.backend import Backend, RolloutBackend, local_model_dir

from skip_plugin_vllm.options import VLLMOptions, check_installed


class VLLM(Backend[VLLMOptions]):
    name = "vllm"
    section = "rollout.engine_kwargs.vllm"
    Options = VLLMOptions
    joins_weight_group = True
    verl_keys: Mapping[str, str] = {
        "tensor_model_parallel_size": "tensor_parallel_size",
        "gpu_memory_utilization": "gpu_memory_utilization",
        "override_config": "hf_overrides",
    }

    def check(self, options: VLLMOptions) -> None:
        check_installed()

    def devices(self, options: VLLMOptions) -> int:
        return options.tensor_parallel_size

    def build(self, options: VLLMOptions, model_dir: Path) -> RolloutBackend:
        from skip_plugin_vllm.engine import VLLMBackend

        return VLLMBackend(options, local_model_dir(model_dir))


@hookimpl
def skip_register_backends(register):
    register(VLLM())
