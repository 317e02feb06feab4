"""Rollout backend ``sglang``: SGLang's offline ``Engine`` in each rollout worker, on CUDA.

Select it with ``rollout.backend=sglang``; engine options live under ``rollout.engine_kwargs.sglang``
(see the README). Without CUDA or without SGLang, the driver refuses the backend before any work.
"""

from skip_core import hookimpl

from skip_plugin_sglang.options import parse_options


class SGLangFactory:
    """``check`` runs in the driver before any worker starts; the call builds an engine in a worker."""

    def check(self, config):
        parse_options(config, with_model=False)

    def __call__(self, config):
        from skip_plugin_sglang.engine import SGLangBackend

        return SGLangBackend(parse_options(config))


@hookimpl
def skip_register_backends(register):
    register("sglang", SGLangFactory())
