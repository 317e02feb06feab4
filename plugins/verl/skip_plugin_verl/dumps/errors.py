"""The two errors a verl dump's readers raise, each printed by ``skip cache import-verl`` as one line."""

from __future__ import annotations

import pickle


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle this importer refuses: it names a global outside the allow-list (which could run
    code, or holds unstorable data), or it is malformed or lies about its sizes."""


class VerlDumpError(ValueError):
    """A dump that is not in verl's rollout-skip format or cannot be stored as a skip entry."""
