"""Rollout backend ``hf``: Hugging Face transformers on CPU or one GPU, concurrent requests batched.

Select it with ``rollout.backend=hf``; settings live under ``rollout.hf`` (see the README).
"""

import os

from skip_core import hookimpl

from skip_plugin_hf.config import HFConfig


class HFFactory:
    """``check`` runs in the driver before any worker starts; the call builds an engine in a worker."""

    # torch and transformers take seconds to import: only when this backend is chosen, not when
    # `skip plugins` lists what is installed.
    def check(self, sections):
        if "RAY_ADDRESS" in os.environ:  # the workers' machines are not the driver's
            return
        from skip_plugin_hf.options import check_device

        check_device(sections[HFConfig].device)

    def __call__(self, sections, model_dir):
        from skip_plugin_hf.engine import HFBackend
        from skip_plugin_hf.options import resolve

        return HFBackend(resolve(sections[HFConfig], model_dir))


@hookimpl
def skip_register_sections(register):
    register("rollout.hf", HFConfig)


@hookimpl
def skip_register_backends(register):
    register("hf", HFFactory())
