"""Python imports this at start in every process with this folder on ``PYTHONPATH`` (README.md)."""

import sglang_on_cpu  # noqa: F401
