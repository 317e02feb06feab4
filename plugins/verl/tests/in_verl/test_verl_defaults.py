"""skip's table of verl's defaults (``skip_plugin_trainer.config.verl_defaults``) against verl 0.9.1's
composed ``ppo_trainer.yaml``, key by key through skip's own map of verl's paths."""

from __future__ import annotations

import fnmatch
import warnings
from pathlib import Path

import verl
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from skip_plugin_trainer.commands import compose_config
from skip_plugin_trainer.config.settings import RunSettings
from skip_plugin_trainer.config.verl_defaults import NOT_COMPARED, VERL_DEFAULTS
from skip_plugin_trainer.config.verl_keys import alias


def verl_defaults() -> dict[str, object]:
    """verl's default at each skip path one of its keys maps to (interpolations resolved)."""
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        config = compose("ppo_trainer")
    found = {}
    for path in _leaves(OmegaConf.to_container(config, resolve=False)):
        value = OmegaConf.select(config, path, throw_on_resolution_failure=False)
        found.setdefault(alias(path), OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
    return found


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def skip_defaults() -> dict[str, object]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dump = RunSettings.from_config(compose_config(None, "run", ())).dump()
    return dict(_flat(dump))


def _flat(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_every_value_in_the_table_is_verls():
    verl_side = verl_defaults()
    assert {path: verl_side.get(path, "<not a verl key>") for path in VERL_DEFAULTS} == VERL_DEFAULTS


def test_every_other_compared_key_has_verls_default_under_skip_run():
    verl_side, skip_side = verl_defaults(), skip_defaults()
    compared = [
        path for path in skip_side
        if path in verl_side and path not in VERL_DEFAULTS
        and not any(fnmatch.fnmatch(path, pattern) for pattern in NOT_COMPARED)
    ]  # fmt: skip
    assert len(compared) > 40  # the algorithm's keys, sampling's, the data's
    assert {path: skip_side[path] for path in compared} == {path: verl_side[path] for path in compared}
