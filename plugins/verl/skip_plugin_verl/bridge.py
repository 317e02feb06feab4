"""verl's own ``SkipManager`` served by skip, patched in place when ``verl.utils.skip`` is imported.

verl's trainers call ``SkipManager.init(config)``, ``set_step(step)`` and decorate with
``@SkipManager.annotate(role=...)`` (``RayPPOTrainer.fit``, ``AgentLoopManager.generate_sequences``,
the fully-async ``Rollouter`` and its ``generate_sequences_single``) and, in the V1 trainer,
``@SkipManager.annotate_tq(role, phase)``. ``install`` replaces those four class methods, on the
class every verl module imports, by skip's: the roles are the installed skip roles,
``skip.<role>`` is validated by skip, and results go to skip's verified store. A replayed result
comes back as a verl ``DataProto`` (``plugin.skip_warp``); ``annotate_tq`` serves skip's role
``rollout_tq`` (module ``rollout_tq``), and ``init`` wraps the trainers' reward, old log-prob,
reference log-prob and value phases for skip's roles of those names (module ``phases``).
``skip.profiling`` is no role: ``init`` hands it to ``profiling``, which puts skip's spans into
verl's trainer and agent loop (``install`` instruments them as they load).

What stays verl's: a role registered with verl's ``register_skip`` that no skip plugin provides,
served by verl's own code with a warning; and the whole manager on a verl version not in
``TESTED``, or with ``SKIP_PLUGINS`` leaving this distribution out.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

from skip_plugin_verl import phases, profiling, rollout_tq, served

DISTRIBUTION = "skip-plugin-verl"
TESTED = ("0.9.1",)
# Where verl's own code leaves each role's pickled dumps under a namespace directory.
VERL_DUMPS = {"rollout_tq": "*/*/tq_batch.pt"}
VERL_DUMP = "*/gen_batch.dp"


class VerlBridgeWarning(UserWarning):
    """The bridge is off for this verl, or a verl feature it does not cover is in use."""


def install(module: ModuleType) -> bool:
    """Serve ``module.SkipManager`` with skip; ``False`` where verl keeps its own."""
    from skip_core.plugins import allowed

    if not allowed(DISTRIBUTION):
        return False
    found = getattr(sys.modules.get("verl"), "__version__", None)
    if found not in TESTED:
        warnings.warn(
            f"{DISTRIBUTION}: verl {found} is not a version this bridge was tested with ({', '.join(TESTED)}); "
            "verl's own SkipManager stays in use",
            VerlBridgeWarning,
            stacklevel=2,
        )
        return False
    manager = module.SkipManager
    verl_annotate_tq = manager.annotate_tq
    manager.init = classmethod(_init)
    manager.set_step = classmethod(_set_step)
    manager.annotate = classmethod(_annotate)
    manager.annotate_tq = classmethod(functools.partial(_annotate_tq, verl_annotate_tq))
    manager.served_by = DISTRIBUTION
    profiling.install()
    return True


def _init(cls: type, config: Any) -> None:
    from skip_core import SkipManager
    from skip_core.config import select, to_container
    from skip_core.plugins import registry

    section, spans_section = profiling.take(to_container(select(config, "skip")))
    spans_settings = profiling.parse(spans_section)  # validated before any store opens
    verl_only = _verl_only(section, registry().roles)
    ours = {k: v for k, v in section.items() if k not in verl_only} if verl_only or spans_section is not None else None
    SkipManager.init(config if ours is None else _WithSkip(config, ours))
    SkipManager.set_step(-1)
    cls.step = -1
    rollout_tq.reset(config)
    served.reset()
    phases.install(lambda: cls.step)
    cls.skip_instances = _verl_instances(verl_only, config)
    _retire_legacy_rollout_skip(config)
    _point_at_verl_dumps()
    profiling.start_driver(spans_settings, cls)


def _set_step(cls: type, step: int) -> None:
    from skip_core import SkipManager

    served.check(step)
    SkipManager.set_step(step)
    cls.step = step


def _annotate(cls: type, role: str, **kwargs: Any):
    """skip's ``annotate``, each call marking its role as one verl's trainer reaches (``served``)."""
    from skip_core import SkipManager

    decorate = SkipManager.annotate(role, **kwargs)

    def marking(fn: Any) -> Any:
        inner = decorate(fn)
        if inspect.iscoroutinefunction(fn):

            async def call(*args: Any, **kw: Any) -> Any:
                served.reached(role)
                return await inner(*args, **kw)
        else:

            def call(*args: Any, **kw: Any) -> Any:
                served.reached(role)
                return inner(*args, **kw)

        return functools.wraps(fn)(call)

    return marking


def _annotate_tq(verl_annotate_tq: Any, cls: type, role: str, phase: str):
    from skip_core.plugins import registry

    if role not in registry().roles:  # a role verl's own code serves (``register_skip``)
        return verl_annotate_tq(role=role, phase=phase)
    return rollout_tq.annotate_tq(role, phase, lambda: cls.step)


def _verl_only(section: Any, roles: Mapping[str, Any]) -> dict[str, Any]:
    """Sections of roles verl registers (``register_skip``) and no installed skip plugin provides."""
    from verl.utils.skip.base_skip import SKIP_REGISTRY

    if not isinstance(section, Mapping):
        return {}  # skip's init reports it, naming the key
    return {name: raw for name, raw in section.items() if name in SKIP_REGISTRY and name not in roles}


def _verl_instances(sections: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """verl's own instances of its enabled roles that skip does not provide, as verl's init makes them."""
    if not sections:
        return {}
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.skip.base_skip import SKIP_REGISTRY
    from verl.utils.skip.config import SkipManagerConfig

    parsed = omega_conf_to_dataclass(dict(sections), dataclass_type=SkipManagerConfig)
    instances = {}
    for name in sections:
        local = getattr(parsed, name, None)
        if local is not None and local.enable:
            warnings.warn(
                f"skip.{name}: no installed skip plugin provides this verl role; verl's own code serves it "
                "(pickled dumps, loaded unverified)",
                VerlBridgeWarning,
                stacklevel=3,
            )
            instances[name] = SKIP_REGISTRY[name](local, config)
    return instances


def _retire_legacy_rollout_skip(config: Any) -> None:
    """verl's older ``actor_rollout_ref.rollout.skip`` must not run alongside ``skip.rollout``: it is turned off."""
    from skip_core import SkipManager
    from skip_core.config import select

    legacy = select(config, "actor_rollout_ref.rollout.skip")
    if "rollout" not in SkipManager.stores() or legacy is None or not select(legacy, "enable"):
        return
    warnings.warn(
        "actor_rollout_ref.rollout.skip.enable is deprecated and ignored because skip.rollout.enable is true; "
        "it has been set to False",
        DeprecationWarning,
        stacklevel=3,
    )
    from omegaconf import DictConfig, open_dict, read_write

    if isinstance(legacy, DictConfig):
        with read_write(legacy), open_dict(legacy):
            legacy.enable = False
    else:
        legacy["enable"] = False


def _point_at_verl_dumps() -> None:
    """Say once, at init, where verl's own dumps of a role are: skip never reads nor replaces them."""
    from skip_core import SkipManager
    from skip_core.store import safe_name
    from verl.utils.skip.base_skip import SKIP_REGISTRY

    for role, store in SkipManager.stores().items():
        if role not in SKIP_REGISTRY:
            continue
        run = store.namespace.experiment_name + "_" + store.namespace.project_name
        verl_dir = store.root / safe_name(run) / store.namespace.shape  # verl's layout, for every role
        pattern = VERL_DUMPS.get(role, VERL_DUMP)
        found = list(verl_dir.glob(pattern))
        if found:
            option = "" if role in VERL_DUMPS else f" --role {role}"  # a tq_batch.pt is rollout_tq's, always
            warnings.warn(
                f"skip.{role}: {len(found)} verl dump(s) in {verl_dir} ({pattern.rsplit('/', 1)[-1]}, pickles) "
                "are never loaded and left in place; convert them once into another dump_dir with "
                f"`skip cache import-verl {store.root} NEW_DUMP_DIR --trust-pickle{option}`",
                VerlBridgeWarning,
                stacklevel=3,
            )


class _WithSkip(Mapping):
    """A run config whose ``skip`` section is replaced; every other key reads the original node."""

    def __init__(self, config: Any, section: Mapping[str, Any]) -> None:
        self._config, self._section = config, section

    def __getitem__(self, key: str) -> Any:
        return self._section if key == "skip" else self._config[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._config)

    def __len__(self) -> int:
        return len(self._config)


def dataproto_class(prompts: Any) -> type | None:
    """verl's ``DataProto`` if ``prompts`` is one (verl imported), else ``None``."""
    protocol = sys.modules.get("verl.protocol")
    cls = getattr(protocol, "DataProto", None)
    return cls if cls is not None and isinstance(prompts, cls) else None


def to_dataproto(batch: Any, cls: type) -> Any:
    """A loaded skip ``Batch`` as verl's ``DataProto`` (tensors in a TensorDict, ``None`` if there are none)."""
    tensors, non_tensors = dict(batch.batch), dict(batch.non_tensor_batch)
    return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=dict(batch.meta_info))
