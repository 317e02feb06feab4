"""Rollout backend ``hf``: Hugging Face transformers on CPU or one GPU, concurrent requests batched.

Select it with ``rollout.backend=hf``; settings live under ``rollout.hf`` (see the README).
"""

from skip_core import hookimpl


class HFFactory:
    """``check`` runs in the driver before any worker starts; the call builds an engine in a worker."""

    # torch and transformers take seconds to import: only when this backend is chosen, not when
    # `skip plugins` lists what is installed.
    def check(self, config):
        from skip_plugin_hf.options import parse_options

        parse_options(config, with_model=False)

    def __call__(self, config):
        from skip_plugin_hf.engine import HFBackend
        from skip_plugin_hf.options import parse_options

        return HFBackend(parse_options(config))


@hookimpl
def skip_register_backends(register):
    register("hf", HFFactory())
