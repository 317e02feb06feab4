"""skip: skip, cache and replay stages of RL post-training, extended by plugins."""

from skip_core.config import ConfigError, RoleConfig
from skip_core.hookspecs import hookimpl
from skip_core.manager import SkipManager
from skip_core.roles import Call, Hit, Role

__all__ = ["Batch", "Call", "ConfigError", "Hit", "Role", "RoleConfig", "SkipManager", "hookimpl"]


def __getattr__(name: str):
    # Batch needs torch; importing skip_core for SkipManager or the CLI must not.
    if name == "Batch":
        from skip_core.batch import Batch

        return Batch
    raise AttributeError(f"module 'skip_core' has no attribute {name!r}")
