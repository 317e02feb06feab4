"""Rollout backend ``vllm``: vLLM's async engine in each rollout worker.

Select it with ``rollout.backend=vllm``; engine options live under ``rollout.engine_kwargs.vllm``
(see the README). vLLM is imported only when the backend is built: ``skip plugins`` and the
driver's option check do not pay for it.
"""

from skip_core import hookimpl

from skip_plugin_vllm.options import parse_options


class VLLMFactory:
    """``check`` runs in the driver before any worker starts; the call builds an engine in a worker."""

    def check(self, config):
        parse_options(config, with_model=False)

    def __call__(self, config):
        from skip_plugin_vllm.engine import VLLMBackend

        return VLLMBackend(parse_options(config))


@hookimpl
def skip_register_backends(register):
    register("vllm", VLLMFactory())
