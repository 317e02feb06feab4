"""Rollout backend ``hf``: Hugging Face transformers on CPU or one GPU, concurrent requests batched.

Select it with ``rollout.backend=hf``; settings live under ``rollout.hf`` (see the README).
"""

from skip_core import hookimpl


@hookimpl
def skip_register_backends(register):
    register("hf", create_backend)


def create_backend(config):
    """Build the backend from the ``rollout`` config section."""
    # torch and transformers take seconds to import: only when this backend is chosen, not when
    # `skip plugins` lists what is installed.
    from skip_plugin_hf.engine import HFBackend
    from skip_plugin_hf.options import parse_options

    return HFBackend(parse_options(config))
