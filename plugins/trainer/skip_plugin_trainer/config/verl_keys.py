"""verl's key paths under ``skip run``: resolved to skip's before the one validation pass.

A verl launch script passes ``actor_rollout_ref.rollout.n=5``; skip's trainer calls that key
``rollout.n``. ``resolve`` rewrites a run config (plain data, after Hydra) so that every key is
one of skip's, and sorts each verl key into one of four kinds:

The three tables are ``verl_tables.py``'s:

- an alias (``ALIASES``): the same setting at skip's path, moved there; a verl path a user wrote
  wins over skip's default at the same place;
- a key that only tunes verl's GPU parallelism, memory or speed, or verl's own logging and files
  (``UNUSED``): dropped, and listed in one warning that says why each changes nothing here;
- a key that changes the algorithm in a way skip does not implement (``UNIMPLEMENTED``): accepted
  at verl's default, which asks for what skip does anyway, and refused in one line otherwise;
- a few whose meaning depends on their value or on another key (``_MAPPINGS``), mapped to skip's.

Every other key goes on to the sections' models, which refuse a key they do not declare: no key
is accepted and ignored.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from skip_core.config import ConfigError

from skip_plugin_trainer.config.verl_tables import ALIASES, NOT_VERLS, UNIMPLEMENTED, UNUSED


@dataclass
class Resolved:
    """A run config in skip's paths, with where each moved key came from and what was dropped."""

    config: dict[str, Any]
    origins: dict[str, str] = field(default_factory=dict)  # skip path -> the verl path written
    unused: dict[str, str] = field(default_factory=dict)  # key as written -> why it changes nothing

    def warning(self) -> str | None:
        """One line listing the dropped keys, grouped by why, or None."""
        if not self.unused:
            return None
        groups: dict[str, list[str]] = {}
        for key, why in self.unused.items():
            groups.setdefault(why, []).append(key)
        parts = [f"{', '.join(sorted(keys))} ({why})" for why, keys in groups.items()]
        return "verl keys that change nothing here, accepted and unused: " + "; ".join(parts)

    def written(self, key: str) -> str:
        """``key`` as the user wrote it: its verl path, when it was one (or, for a section an
        error names, the verl path of the keys written under it)."""
        for prefix in sorted(self.origins, key=len, reverse=True):
            if key == prefix or key.startswith(f"{prefix}."):
                return self.origins[prefix] + key[len(prefix) :]
        for path, origin in self.origins.items():
            tail = path[len(key) :]
            if path.startswith(f"{key}.") and origin.endswith(tail):
                return origin[: len(origin) - len(tail)]
        return key


def resolve(config: Any) -> Resolved:
    """Move verl's paths to skip's, then (interpolations resolved against the moved values, so a
    shipped ``${actor.ppo_mini_batch_size}`` follows a script's ``actor_rollout_ref.actor.*``)
    drop the keys that change nothing here and refuse unimplemented ones."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(config, resolve=False) if OmegaConf.is_config(config) else config
    resolved = Resolved({})
    moved: list[tuple[str, str, Any]] = []
    for path, value in _leaves(raw):
        target = alias(path)
        if target == path:
            _put(resolved.config, path, value)
        else:
            moved.append((path, target, value))
    for path, target, value in moved:  # a verl path a user wrote wins over skip's default
        earlier = resolved.origins.get(target)
        if earlier is not None and _get(resolved.config, target) != value:
            raise ConfigError(f"{path}: sets {target}, which {earlier} sets to another value")
        _put(resolved.config, target, value)
        resolved.origins[target] = path
    resolved.config = _sorted(resolved, _resolved(resolved.config))
    for mapping in _MAPPINGS:
        mapping(resolved)
    return resolved


def _resolved(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its interpolations resolved; one naming a missing key is an error line."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.create(config), resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise ConfigError(f"{key}: {str(exc).splitlines()[0]}") from None


def _sorted(resolved: Resolved, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` without the keys that change nothing here (listed in ``resolved.unused``);
    an unimplemented key away from verl's default is an error naming it as written."""
    kept: dict[str, Any] = {}
    for path, value in _leaves(config):
        written = resolved.written(path)
        refused = _unimplemented(path)
        if path in NOT_VERLS:
            raise ConfigError(f"{written}: not a key of verl 0.9.1 either (its schema refuses it); {NOT_VERLS[path]}")
        if refused is not None:
            default, instead = UNIMPLEMENTED[refused]
            accepted = default if isinstance(default, tuple) else (default,)
            if path != refused or value not in accepted:  # a key under it sets what the default leaves empty
                key = written[: len(written) - len(path) + len(refused)]
                raise ConfigError(f"{key}: not implemented: {instead} (verl's default is {accepted[0]!r})")
        elif _unused(path) is not None:
            resolved.unused[written] = _unused(path)
        else:
            _put(kept, path, value)
    return kept


def alias(path: str) -> str:
    """skip's path for ``path`` (``actor_rollout_ref.rollout.name`` -> ``rollout.backend``)."""
    for _ in range(len(ALIASES) + 1):
        for prefix in sorted(ALIASES, key=len, reverse=True):
            if (path == prefix or path.startswith(f"{prefix}.")) and ALIASES[prefix] != prefix:
                path = ALIASES[prefix] + path[len(prefix) :]
                break
        else:
            return path
    return path


def _unimplemented(path: str) -> str | None:
    """The ``UNIMPLEMENTED`` key ``path`` is, or lies under."""
    for key in UNIMPLEMENTED:
        if path == key or path.startswith(f"{key}."):
            return key
    return None


def _unused(path: str) -> str | None:
    for pattern, why in UNUSED.items():
        if fnmatch.fnmatchcase(path, pattern):
            return why
    return None


def _leaves(node: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, value)`` for every value that is not a non-empty mapping."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{path}.")
        else:
            yield path, value


def _put(config: dict[str, Any], path: str, value: Any) -> None:
    *parents, name = path.split(".")
    node = config
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[name] = value


def _get(config: Mapping[str, Any], path: str, default: Any = None) -> Any:
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _pop(config: dict[str, Any], path: str) -> Any:
    *parents, name = path.split(".")
    node = _get(config, ".".join(parents)) if parents else config
    return node.pop(name, None) if isinstance(node, dict) else None


# -- keys whose meaning depends on a value -------------------------------------------------


def _multi_turn(resolved: Resolved) -> None:
    """verl's ``multi_turn.enable``: off is one assistant turn and no tools; on is skip's loop."""
    config = resolved.config
    enable = _pop(config, "rollout.multi_turn.enable")
    if enable is False:
        _put(config, "rollout.multi_turn.tools_config", None)
        _put(config, "rollout.multi_turn.max_turns", 1)


def _clip_ratio(resolved: Resolved) -> None:
    """verl's symmetric ``actor.clip_ratio`` stands for whichever bound is not given its own."""
    config = resolved.config
    ratio = _pop(config, "actor.clip_ratio")
    if ratio is None:
        return
    written = resolved.origins.get("actor.clip_ratio", "actor.clip_ratio")
    for bound in ("actor.clip_ratio_low", "actor.clip_ratio_high"):
        if bound not in resolved.origins:
            _put(config, bound, ratio)
            resolved.origins[bound] = written


_MANAGERS = ("naive", "dapo", "gdpo")


def _reward_manager(resolved: Resolved) -> None:
    """verl's reward managers skip has, as ``reward.manager``: ``naive`` (the function's score),
    ``dapo`` (plus the overlong buffer when ``overlong_buffer.enable``) and ``gdpo`` (the
    function also told the experiment's name)."""
    config = resolved.config
    for key in ("reward_model.reward_manager", "reward.reward_manager.name"):
        name = _pop(config, key)
        if name is None:
            continue
        _put(config, "reward.manager", name)
        if name not in _MANAGERS:
            raise ConfigError(
                f"{key}: {name!r} is not implemented: skip's reward is the function's score, with DAPO's "
                f"overlong buffer when reward.overlong_buffer.enable (allowed: {', '.join(_MANAGERS)})"
            )
        if name == "naive" and _get(config, "reward.overlong_buffer.enable"):
            raise ConfigError(
                f"{key}: naive has no overlong buffer, but reward.overlong_buffer.enable is true; use dapo"
            )
    length = _pop(config, "reward.reward_kwargs.max_resp_len")
    if length is not None and length != _get(config, "data.max_response_length"):
        raise ConfigError(
            f"reward.reward_kwargs.max_resp_len: {length!r} is not implemented: skip's overlong buffer ends at "
            f"data.max_response_length ({_get(config, 'data.max_response_length')!r})"
        )
    for empty in ("reward_model", "reward.reward_manager", "reward.reward_kwargs"):
        if _get(config, empty) == {}:
            _pop(config, empty)


def _critic_model(resolved: Resolved) -> None:
    """verl's ``critic.model.path``: skip's critic starts from the policy's weights (model.path)."""
    path = _pop(resolved.config, "critic.model.path")
    policy = _get(resolved.config, "model.path")
    if path is not None and path != policy:
        raise ConfigError(
            f"critic.model.path: {path!r} is not implemented: skip's critic starts from model.path ({policy!r})"
        )
    if _get(resolved.config, "critic.model") == {}:
        _pop(resolved.config, "critic.model")


def _fully_async_batch(resolved: Resolved) -> None:
    """``data.train_batch_size=0``, as verl's fully-async launches write it: prompts stream one by
    one, and an update takes ``actor.ppo_mini_batch_size x async_training.require_batches``."""
    config = resolved.config
    if _get(config, "data.train_batch_size") != 0:
        return
    schedule = _get(config, "trainer.schedule", "sync")
    if schedule != "fully_async":
        raise ConfigError(
            f"data.train_batch_size: 0 is fully-async's (prompts stream one by one), not {schedule}'s; "
            "set trainer.schedule=fully_async or a batch size"
        )
    mini = _get(config, "actor.ppo_mini_batch_size")
    batches = _get(config, "async_training.require_batches") or 1
    if isinstance(mini, int) and isinstance(batches, int):
        _put(config, "data.train_batch_size", mini * batches)
        _put(config, "async_training.require_batches", batches)


def _total_rollout_steps(resolved: Resolved) -> None:
    """fully-async's ``rollout.total_rollout_steps``: the prompts the rollouter feeds in all, so
    that many over the prompts of one update is the run's length in updates (it sets
    ``trainer.total_training_steps``, as it sets the length of verl's fully-async run)."""
    config = resolved.config
    total = _pop(config, "rollout.total_rollout_steps")
    if total is None:
        return
    if _get(config, "trainer.schedule", "sync") != "fully_async":
        raise ConfigError(
            "rollout.total_rollout_steps: fully-async's length in prompts; set trainer.schedule=fully_async"
        )
    batch = _get(config, "data.train_batch_size")
    if not isinstance(total, int) or total < 1 or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"rollout.total_rollout_steps: expected a number of prompts >= 1, got {total!r}")
    steps, before = max(1, total // batch), _get(config, "trainer.total_training_steps")
    if before is not None and before != steps:  # the shipped run.yaml's 20, or the user's: said either way
        warnings.warn(
            f"rollout.total_rollout_steps={total}: sets trainer.total_training_steps to {steps} "
            f"({total} prompts / {batch} per update), not {before}",
            stacklevel=4,
        )
    _put(config, "trainer.total_training_steps", steps)


ENGINE_KEYS = ("tensor_model_parallel_size", "gpu_memory_utilization")


def _engine_keys(resolved: Resolved) -> None:
    """verl's ``rollout.tensor_model_parallel_size`` and ``gpu_memory_utilization`` go to the
    options of the engine ``rollout.backend`` names (``Backend.verl_keys``: vLLM's
    ``tensor_parallel_size``, SGLang's ``tp_size``...). An engine without them runs on one
    device and allocates as it generates: tensor parallelism there is refused, the memory share
    unused."""
    from skip_core.plugins import registry

    config = resolved.config
    name = _get(config, "rollout.backend", "hf")
    backend = registry().backends.get(name)
    for key in ENGINE_KEYS:
        path = f"rollout.{key}"
        written = resolved.written(path)
        value = _pop(config, path)
        if value is None or backend is None:  # an unknown backend is named when the sections are read
            continue
        option = backend.verl_keys.get(key)
        if option is None or backend.section is None:
            one_device = f"rollout.backend={name} runs each engine on one device"
            if key == "tensor_model_parallel_size" and value != 1:
                raise ConfigError(f"{written}: {one_device}; tensor parallelism needs rollout.backend=vllm or sglang")
            why = f"rollout.backend={name} allocates its memory as it generates"
            resolved.unused[written] = one_device if key == "tensor_model_parallel_size" else why
            continue
        target = f"{backend.section}.{option}"  # the verl path wins over skip's default, as an alias's does
        _put(config, target, value)
        resolved.origins[target] = written
    _override_config(resolved, name, backend)


def _override_config(resolved: Resolved, name: str, backend: Any) -> None:
    """``model.override_config`` stays the trainer's (the policy, its reference, the critic) and
    is copied to the engine's own option for it (``Backend.verl_keys["override_config"]``: hf's
    ``config_overrides``, vLLM's ``hf_overrides``, SGLang's ``json_model_override_args``)."""
    config = resolved.config
    value = _get(config, "model.override_config")
    if not value or backend is None:
        return
    option = backend.verl_keys.get("override_config")
    if option is None or backend.section is None:
        raise ConfigError(
            f"{resolved.written('model.override_config')}: rollout.backend={name} takes no overrides of the "
            "model's config; its engine would generate from another model than the one trained"
        )
    target = f"{backend.section}.{option}"
    if _get(config, target):
        raise ConfigError(f"{target}: set by model.override_config too; give the overrides once, there")
    _put(config, target, value)
    resolved.origins[target] = resolved.written("model.override_config")


CHECKPOINT_ENGINES = {"naive": "auto", "nccl": "group"}


def _checkpoint_engine(resolved: Resolved) -> None:
    """verl's ``rollout.checkpoint_engine.backend``, as ``rollout.weight_sync``: ``naive`` (verl's
    colocated default) leaves the choice to skip, ``nccl`` asks for the process group."""
    written = resolved.origins.get("rollout.weight_sync", "")
    if not written.endswith("checkpoint_engine.backend"):
        return
    value = _get(resolved.config, "rollout.weight_sync")
    if value not in CHECKPOINT_ENGINES:
        raise ConfigError(
            f"{written}: {value!r} is not implemented; allowed: naive (skip chooses, rollout.weight_sync=auto) "
            "or nccl (a process group, rollout.weight_sync=group)"
        )
    _put(resolved.config, "rollout.weight_sync", CHECKPOINT_ENGINES[value])


_MAPPINGS: list[Callable[[Resolved], None]] = [
    _checkpoint_engine,
    _engine_keys,
    _multi_turn,
    _clip_ratio,
    _reward_manager,
    _critic_model,
    _fully_async_batch,
    _total_rollout_steps,
]
