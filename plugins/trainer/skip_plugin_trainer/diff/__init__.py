"""``skip diff A B``: two runs or two skip caches compared step by step and phase by phase
(``compare``), printed as tables (``report``); runs and caches are read as hostile (``sources``)."""

from skip_plugin_trainer.diff.compare import Report, compare

__all__ = ["Report", "compare"]
