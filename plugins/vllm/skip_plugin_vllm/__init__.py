"""Rollout backend ``vllm``: vLLM's async engine in each rollout worker.

Select it with ``rollout.backend=vllm``; engine options are the section ``rollout.engine_kwargs.vllm``
(see the README). vLLM is imported only when the backend is built: ``skip plugins`` and the
driver's check do not pay for it.
"""

from skip_core import hookimpl
from skip_core.backend import local_model_dir

from skip_plugin_vllm.options import VLLMOptions, check_installed


class VLLMFactory:
    """``check`` runs in the driver before any worker starts; the call builds an engine in a worker."""

    def check(self, sections):
        check_installed()

    def __call__(self, sections, model_dir):
        from skip_plugin_vllm.engine import VLLMBackend

        return VLLMBackend(sections[VLLMOptions], local_model_dir(model_dir))


@hookimpl
def skip_register_sections(register):
    register("rollout.engine_kwargs.vllm", VLLMOptions)


@hookimpl
def skip_register_backends(register):
    register("vllm", VLLMFactory())
