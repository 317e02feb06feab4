"""Rollout backend ``hf``: Hugging Face transformers on CPU or one GPU, concurrent requests batched.

Select it with ``rollout.backend=hf``; settings live under ``rollout.hf`` (see the README).
"""

import os
from collections.abc import Mapping
from pathlib import Path

from skip_core import hookimpl
from skip_core.backend import Backend, RolloutBackend

from skip_plugin_hf.options import HFOptions


class HF(Backend[HFOptions]):
    name = "hf"
    section = "rollout.hf"
    Options = HFOptions
    joins_weight_group = True
    verl_keys: Mapping[str, str] = {"override_config": "config_overrides"}

    # torch and transformers take seconds to import: only when this backend is chosen, not when
    # `skip plugins` lists what is installed.
    def check(self, options: HFOptions) -> None:
        if "RAY_ADDRESS" in os.environ:  # the workers' machines are not the driver's
            return
        from skip_plugin_hf.resolved import check_device

        check_device(options.device)

    def build(self, options: HFOptions, model_dir: Path) -> RolloutBackend:
        from skip_plugin_hf.engine import HFBackend
        from skip_plugin_hf.resolved import resolve

        return HFBackend(resolve(options, model_dir))


@hookimpl
def skip_register_backends(register):
    register(HF())
