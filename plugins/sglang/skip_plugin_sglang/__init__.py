"""Rollout backend ``sglang``: SGLang's offline ``Engine`` in each rollout worker.

Select it with ``rollout.backend=sglang``; engine options live under ``rollout.engine_kwargs.sglang``
(see the README). Without SGLang, or on a CPU without SGLang's CPU kernels, the driver refuses the
backend before any work. SGLang is imported only when the backend is built.
"""

import os
from collections.abc import Mapping
from pathlib import Path

from skip_core import hookimpl
from skip_core.backend import Backend, RolloutBackend, local_model_dir

from skip_plugin_sglang.options import SGLangOptions, check_machine


class SGLang(Backend[SGLangOptions]):
    name = "sglang"
    section = "rollout.engine_kwargs.sglang"
    Options = SGLangOptions
    joins_weight_group = True
    verl_keys: Mapping[str, str] = {
        "tensor_model_parallel_size": "tp_size",
        "gpu_memory_utilization": "mem_fraction_static",
        "override_config": "json_model_override_args",
    }

    def check(self, options: SGLangOptions) -> None:
        if "RAY_ADDRESS" not in os.environ:  # on a cluster, the workers' machines are not the driver's
            check_machine()

    def devices(self, options: SGLangOptions) -> int:
        return options.tp_size

    def build(self, options: SGLangOptions, model_dir: Path) -> RolloutBackend:
        from skip_plugin_sglang.engine import SGLangBackend

        check_machine()
        return SGLangBackend(options, local_model_dir(model_dir))


@hookimpl
def skip_register_backends(register):
    register(SGLang())
