"""The ``skip`` config section: typed models, one-line errors, and the run namespace.

Config arrives as a whole run config (an OmegaConf ``DictConfig`` or a plain dict) with the
top-level key ``skip``, like verl's. It is validated once: by ``SkipManager.init`` inside verl,
by a trainer's own pass before ``SkipManager.activate``; nothing inside a step reads raw config.
"""

from __future__ import annotations

import bisect
import difflib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from skip_core.errors import SkipError

# What this repository's plugin distributions provide, and where each lives in it: an error
# about a missing role, backend or config section names the distribution and how to install it from
# a clone. Nothing is published to a package index, and only what the repository has is listed.
PLUGIN_FOLDERS = {
    ("role", "rollout"): "plugins/rollout",
    ("role", "async_rollout"): "plugins/async_rollout",
    ("role", "ref_log_prob"): "plugins/ref_log_prob",
    ("role", "reward"): "plugins/reward",
    ("role", "old_log_prob"): "plugins/old_log_prob",
    ("role", "values"): "plugins/values",
    ("role", "rollout_tq"): "plugins/verl",
    ("backend", "hf"): "plugins/hf",
    ("backend", "vllm"): "plugins/vllm",
    ("backend", "sglang"): "plugins/sglang",
    ("schedule", "sync"): "plugins/trainer",
    ("schedule", "one_step_off"): "plugins/one_step_off",
    ("schedule", "fully_async"): "plugins/fully_async",
    ("task", "arithmetic"): "plugins/arithmetic",
    ("command", "run"): "plugins/trainer",
    ("command", "rollout"): "plugins/trainer",
    ("command", "diff"): "plugins/trainer",
    ("command", "profile"): "plugins/profiling",
    ("command", "cache import-verl"): "plugins/verl",
    ("command", "simulate"): "plugins/simulate",
    ("section", "profiling"): "plugins/profiling",
    ("section", "async_training"): "plugins/fully_async",
    ("section", "rollout.hf"): "plugins/hf",
    ("section", "rollout.engine_kwargs.vllm"): "plugins/vllm",
    ("section", "rollout.engine_kwargs.sglang"): "plugins/sglang",
}


def install_hint(kind: str, name: str) -> str:
    """How to install the distribution of this repository that provides ``kind`` ``name``, or ``""``."""
    folder = PLUGIN_FOLDERS.get((kind, name))
    if folder is None:
        return ""
    distribution = "skip-plugin-" + folder.rsplit("/", 1)[1].replace("_", "-")
    return f"install {distribution} from a clone of the skip repository: pip install ./{folder}"


M = TypeVar("M", bound=BaseModel)
MISSING = "???"
T = TypeVar("T")


class ConfigError(SkipError, ValueError):
    """Bad configuration; the message names the full key and what is allowed."""


class StepSet:
    """Steps as sorted, disjoint ranges (both ends included): ``1..1000000000000`` is two numbers,
    not a list, so a typo in a range costs nothing until it is used. Iterates in order; ``in`` is
    a comparison or a bisection. Written in config as a step, ``"a..b"``, ``"a.."`` (every step
    from ``a`` on) or a list of them."""

    #: The end of an open range ``a..``.
    OPEN = sys.maxsize

    __slots__ = ("_ends", "_starts")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[list[int]] = []
        for first, last in sorted((int(a), int(b)) for a, b in ranges if a <= b):
            if merged and first <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], last)
            else:
                merged.append([first, last])
        self._starts = tuple(first for first, _ in merged)
        self._ends = tuple(last for _, last in merged)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        i = bisect.bisect_right(self._starts, step) - 1
        return i >= 0 and step <= self._ends[i]

    def __iter__(self) -> Iterator[int]:
        for first, last in self.ranges:
            yield from range(first, last + 1)

    def __len__(self) -> int:
        return min(sum(last - first + 1 for first, last in self.ranges), sys.maxsize)  # "0.." is one more

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepSet):
            return self.ranges == other.ranges
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and list(self) == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._starts, self._ends))

    def above(self, last: int) -> StepSet:
        """The steps after ``last``: those a run ending at ``last`` never reaches."""
        return StepSet((max(first, last + 1), end) for first, end in self.ranges if end > last)

    @property
    def bounded(self) -> StepSet:
        """These steps without an open range (``a..``): the ones a user listed one by one or up to an end."""
        return StepSet(r for r in self.ranges if r[1] != self.OPEN)

    def __str__(self) -> str:
        return ", ".join(map(str, self.as_config()))

    def __repr__(self) -> str:
        return f"StepSet({self})"

    def as_config(self) -> list[int | str]:
        """The form config files write: ``[1, "3..100", "200.."]``."""
        return [a if a == b else f"{a}.." if b == self.OPEN else f"{a}..{b}" for a, b in self.ranges]

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        # The plain steps are validated as a list of non-negative integers, so an error names
        # the item (``steps[1]: expected an integer``); ranges stand in it as their first step.
        # Strict: ``true`` is no step 1, nor ``2.5`` step 2 (digit strings are read before).
        items = core_schema.list_schema(core_schema.int_schema(ge=0, strict=True))
        return core_schema.no_info_wrap_validator_function(
            _parse_steps,
            items,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda steps: steps.as_config() if isinstance(steps, StepSet) else steps
            ),
        )


def _parse_steps(value: Any, validate: Callable[[Any], list[int]]) -> StepSet:
    """``3``, ``"1..20"`` or a list of either as a ``StepSet``; a bad plain step is pydantic's to name."""
    if isinstance(value, StepSet):
        return value
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    ranges: dict[int, tuple[int, int]] = {}
    for index, item in enumerate(items):
        first, dots, last = item.partition("..") if isinstance(item, str) else (item, "", "")
        if not dots:
            items[index] = int(item) if isinstance(item, str) and _digits(item.strip()) else item
            continue
        first, last = first.strip(), last.strip()
        if not (_digits(first) and (_digits(last) or not last)):
            raise ValueError(f"{item!r} is not a range of steps like 1..20")
        end = int(last) if last else StepSet.OPEN
        if int(first) > end:
            raise ValueError(f"the range {item!r} is empty: write the smaller step first")
        ranges[index] = (int(first), end)
        items[index] = int(first)
    steps = validate(items)
    return StepSet([ranges.get(i, (step, step)) for i, step in enumerate(steps)])


def _digits(text: str) -> bool:
    """ASCII digits, at most 18 of them: a step fits a 64-bit integer (``int()`` also takes
    other scripts' digits and would take 10,000 of them)."""
    return 0 < len(text) <= 18 and text.isascii() and text.isdigit()


#: Trainer steps: a step, a range ``a..b`` or a list of them (``StepSet``).
Steps = StepSet


class RoleConfig(BaseModel):
    """``skip.<role>``: shared by every cache role."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable: bool = False
    dump_dir: str = "~/.cache/skip"
    steps: Steps = Field(default_factory=StepSet)
    action: Literal["cache", "repeat"] = "cache"
    # A cache hit whose recorded inputs differ from this call's inputs (see
    # ``skip_core.encoding.fingerprint``): load anyway with a warning, run the function
    # again and replace the entry, or raise ``PromptMismatchError``.
    on_prompt_mismatch: Literal["warn", "regenerate", "error"] = "warn"
    # A cache hit generated under another setup than this run's (model, sampling, backend, tools,
    # chat template: ``skip_core.provenance``): the same three ways, ``SetupMismatchError``.
    on_setup_mismatch: Literal["warn", "regenerate", "error"] = "warn"

    @field_validator("dump_dir", mode="before")
    @classmethod
    def _path_to_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @property
    def dump_path(self) -> str:
        return os.path.expanduser(self.dump_dir)


def parse_section(model: type[M], key: str, raw: Any, nested: Iterable[str] = ()) -> M:
    """Validate one config section, turning pydantic's report into one line naming the key.

    ``nested``: names of sections inside this one, validated apart but allowed here.
    """
    raw = to_container(raw)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key}: expected a mapping of settings, got {raw!r}")
    # "???" is OmegaConf's mark of a mandatory value nobody set: pydantic then reports it missing.
    given = {k: v for k, v in raw.items() if not is_hydra_marker(k) and v != MISSING}
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        raise ConfigError(_one_line(key, model, exc, nested)) from None


def is_hydra_marker(key: Any) -> bool:
    """``_target_``, ``_recursive_`` and the like: instructions to Hydra, not settings (verl has them)."""
    return isinstance(key, str) and len(key) > 2 and key.startswith("_") and key.endswith("_")


def _one_line(key: str, model: type[BaseModel], exc: ValidationError, nested: Iterable[str]) -> str:
    errors = exc.errors()
    first = errors[0]
    loc = key
    for part in first["loc"]:
        loc += f"[{part}]" if isinstance(part, int) else f".{part}" if loc else str(part)  # "": a top level
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    owner = _owner(model, first["loc"])
    return f"{loc}: {_expectation(first, owner, loc, nested if owner is model else ())}{more}"


_EXPECTED = {
    "bool_parsing": "expected true or false",
    "bool_type": "expected true or false",
    "float_parsing": "expected a number",
    "float_type": "expected a number",
    "int_parsing": "expected an integer",
    "int_type": "expected an integer",
    "int_from_float": "expected an integer",
    "list_type": "expected a list of integers",
    "string_type": "expected a string",
}


def _owner(model: type[BaseModel], loc: tuple) -> type[BaseModel]:
    """The (nested) model that declares the field an error is about, for its allowed keys and types."""
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            break
        model = field.annotation
    return model


def _integral(annotation: Any) -> bool:
    """``int``, or a type built on it (``NonNegativeInt``, ``int | None``, ``list[PositiveInt]``)."""
    return annotation in (int, StepSet) or any(_integral(arg) for arg in get_args(annotation))


_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _expectation(error: dict, model: type[BaseModel], loc: str, nested: Iterable[str]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return unknown_key(loc, [*model.model_fields, *nested])
    if kind == "missing":
        return "required, and not set"
    if kind == "string_too_short":
        return f"expected at least {error['ctx']['min_length']} character, got {error['input']!r}"
    if kind == "value_error":  # a validator's own message already says what is allowed
        return str(error["ctx"]["error"])
    if kind == "literal_error":
        expected = error["ctx"]["expected"]
    elif kind in _BOUNDS:
        names = [part for part in error["loc"] if isinstance(part, str)]
        field = model.model_fields.get(names[-1]) if names else None
        number = "an integer" if field is not None and _integral(field.annotation) else "a number"
        expected = f"{number} {_BOUNDS[kind]} {next(iter(error['ctx'].values()))}"
    else:
        expected = _EXPECTED.get(kind, error["msg"].lower()).removeprefix("expected ")
    return f"expected {expected}, got {error['input']!r}"


def unknown_key(key: str, allowed: Iterable[str]) -> str:
    """What follows ``key: `` when ``key`` names nothing: the keys allowed there and the closest one."""
    parent, _, name = key.rpartition(".")
    allowed = sorted(allowed)
    close = difflib.get_close_matches(name, allowed, n=1) or [key for key in allowed if key.startswith(name)][:1]
    hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
    return f"unknown key (allowed: {', '.join(allowed) or 'none'}){hint}"


def select(config: Any, dotted: str) -> Any:
    """Read ``a.b.c`` from a DictConfig or nested dicts; ``None`` when absent or missing."""
    node = config
    for part in dotted.split("."):
        if node is None:
            return None
        try:
            node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
        except Exception:  # OmegaConf raises on '???' (missing mandatory) values
            return None
    return node


def to_container(node: Any) -> Any:
    """A plain-Python copy of a config node (OmegaConf interpolations resolved)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


@dataclass(frozen=True)
class Namespace:
    """The run identity that names a cache directory, read with verl's config keys."""

    experiment_name: str = "default"
    project_name: str = "default"
    gbs: int = 0
    n: int = 1
    prompt_len: int = 0
    response_len: int = 0

    @classmethod
    def from_config(cls, config: Any) -> Namespace:
        gbs_key = "data.gen_batch_size"
        if select(config, gbs_key) is None:
            gbs_key = "data.train_batch_size"
        return cls(
            experiment_name=_text(config, "trainer.experiment_name", cls.experiment_name),
            project_name=_text(config, "trainer.project_name", cls.project_name),
            gbs=_count(config, gbs_key, cls.gbs),
            n=_count(config, "actor_rollout_ref.rollout.n", cls.n),
            prompt_len=_count(config, "data.max_prompt_length", cls.prompt_len),
            response_len=_count(config, "data.max_response_length", cls.response_len),
        )

    @property
    def shape(self) -> str:
        return f"GBS{self.gbs}_N{self.n}_in{self.prompt_len}_out{self.response_len}"


def _text(config: Any, key: str, default: str) -> str:
    value = select(config, key)
    return default if value is None else str(value)


def _count(config: Any, key: str, default: int) -> int:
    value = select(config, key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key}: expected an integer >= 0, got {value!r}")
    return value


def lookup(key: str, kind: str, name: str, installed: Mapping[str, T]) -> T:
    """The plugin-provided ``kind`` called ``name``, or a ConfigError naming what is installed
    and, for one this repository ships, how to install it."""
    if name in installed:
        return installed[name]
    have = ", ".join(sorted(installed)) or "none"
    hint = install_hint(kind, name)
    raise ConfigError(f"{key}: unknown {kind} {name!r} (installed: {have})" + (f"; {hint}" if hint else ""))
