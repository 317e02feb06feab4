"""``skip cache import-verl``: find verl's rollout-skip dumps and store each as a skip entry.

verl 0.9.1 (``verl/utils/skip/rollout_skip.py``, ``RolloutSkip.prepare_data``) writes, per
dumped step::

    {dump_dir}/{experiment_name}_{project_name}/GBS{gbs}_N{n}_in{prompt}_out{response}/{step}/
        gen_batch.dp    DataProto.save_to_disk: pickle.dump of the DataProto
        meta.json       {"global_steps": step}

and, for the V1 trainer's ``rollout_tq`` (``RolloutTqSkip.prepare_data``), one directory per
``sample`` call of the step (``inner``: 0 unless ``parameter_sync_step`` > 1)::

    {dump_dir}/{experiment_name}_{project_name}/GBS.../{step}/{inner}/
        tq_batch.pt     torch.save of the trajectories' TensorDict, keys and tags
        meta.json       {"global_steps": step, "num_trajectories": ...}

The directory names give the skip namespace and step of a dump (``target_of``); a
``tq_batch.pt`` becomes the ``inner``-th generation of a ``rollout_tq`` entry. Dumps are read
only by ``verl_pickle.read_gen_batch`` and ``tq_pickle.read_tq_batch``, which resolve no global
outside their allow-lists; the CLI still requires ``--trust-pickle``. verl records no prompt
fingerprint: the imported entries replay onto whatever prompts a step draws, as verl's do.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from skip_core import reading
from skip_core.config import Namespace
from skip_core.escaping import printable
from skip_core.store import CacheStore

from skip_plugin_verl.dumps.errors import VerlDumpError
from skip_plugin_verl.dumps.tq_pickle import read_tq_batch
from skip_plugin_verl.dumps.verl_pickle import read_gen_batch

GEN_BATCH = "gen_batch.dp"
VERL_META = "meta.json"
TQ_BATCH = "tq_batch.pt"  # verl's rollout_tq (TransferQueue) dumps, imported as skip's rollout_tq
SHAPE = re.compile(r"GBS(\d+)_N(\d+)_in(\d+)_out(\d+)")
MAX_VERL_META_BYTES = 1 << 20


class ImportedSteps(list):
    """The step directories written (a ``list[Path]``); ``failed`` lists ``(source, reason)``."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: list[tuple[Path, str]] = []


# -- verl's layout ---------------------------------------------------------------------------


def find_dumps(src: Path) -> Iterator[Path]:
    """Every ``gen_batch.dp`` and ``tq_batch.pt`` under ``src``, in (directory, step) order; links
    never followed, and a tree nested past Python's recursion limit walked all the same."""
    found = []
    for dirpath, _, filenames in reading.walk(src):
        found.extend(dirpath / name for name in (GEN_BATCH, TQ_BATCH) if name in filenames)
    yield from sorted(found, key=_order)


def _order(path: Path) -> tuple:
    """Sort key of a dump: its directories by name, numeric ones (steps) by value, before the others."""
    parts = path.parent.parts
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


def split_run_name(run: str, experiment_name: str | None = None, project_name: str | None = None) -> tuple[str, str]:
    """``(experiment_name, project_name)`` of verl's ``{experiment_name}_{project_name}`` directory.

    Either name may hold ``_``: a name that is given settles where to split; a run that still
    splits more than one way is refused rather than guessed.
    """
    if experiment_name is not None and project_name is not None:
        if f"{experiment_name}_{project_name}" != run:
            raise VerlDumpError(
                f"run directory {run!r} is not experiment {experiment_name!r} + '_' + project {project_name!r}"
            )
        return experiment_name, project_name
    splits = [(run[:i], run[i + 1 :]) for i, c in enumerate(run) if c == "_"]
    if not splits:
        raise VerlDumpError(f"run directory {run!r} is not verl's {{experiment_name}}_{{project_name}}")
    if experiment_name is not None:
        splits = [s for s in splits if s[0] == experiment_name]
        if not splits:
            raise VerlDumpError(f"run directory {run!r} does not start with experiment name {experiment_name!r} + '_'")
    elif project_name is not None:
        splits = [s for s in splits if s[1] == project_name]
        if not splits:
            raise VerlDumpError(f"run directory {run!r} does not end with '_' + project name {project_name!r}")
    if len(splits) > 1:
        options = ", ".join(f"{e!r} + {p!r}" for e, p in splits)
        raise VerlDumpError(
            f"cannot tell experiment_name from project_name in run directory {run!r} ({options}); "
            "pass the experiment name or the project name (--experiment-name / --project-name)"
        )
    return splits[0]


def _verl_meta(step_dir: Path) -> dict:
    """verl's ``meta.json`` of a step (size-bounded); verl writes it last, so a step without one is incomplete."""
    path = step_dir / VERL_META
    try:
        meta = reading.read_json(path, MAX_VERL_META_BYTES)  # a regular file, bounded in size and nesting
    except FileNotFoundError:
        raise VerlDumpError(f"incomplete verl dump: {path} is missing (verl skips such a step too)") from None
    except reading.UnsafeFile as exc:  # a pipe, a link, too large, too deep, not JSON
        raise VerlDumpError(f"{path} is not verl's meta.json ({exc})") from None
    if not isinstance(meta, dict):
        raise VerlDumpError(f"{path} is not verl's meta.json")
    return meta


def target_of(
    dump: Path, experiment_name: str | None = None, project_name: str | None = None
) -> tuple[Namespace, int, int, list[str]]:
    """The skip namespace, step and generation (the ``inner`` call of a ``tq_batch.pt``, else 0)
    of a dump, from verl's layout; plus warnings."""
    meta_dir = dump.absolute().parent
    inner = meta_dir.name if dump.name == TQ_BATCH else "0"
    step_dir = meta_dir.parent if dump.name == TQ_BATCH else meta_dir
    shape_dir = step_dir.parent
    match = SHAPE.fullmatch(shape_dir.name)
    if not step_dir.name.isdigit() or not inner.isdigit() or match is None:
        layout = "{step}/{inner}/" if dump.name == TQ_BATCH else "{step}/"
        shape = "GBS{gbs}_N{n}_in{prompt}_out{response}"
        raise VerlDumpError(f"not in verl's layout {{dump_dir}}/{{experiment}}_{{project}}/{shape}/{layout}")
    step = int(step_dir.name)
    meta = _verl_meta(meta_dir)
    warnings = []
    if "global_steps" in meta and meta["global_steps"] != step:
        warnings.append(f"meta.json records global_steps {meta['global_steps']!r}; using the directory's step {step}")
    run = shape_dir.parent.name
    named = meta.get("experiment_name"), meta.get("project_name")
    if experiment_name is None and project_name is None and all(isinstance(n, str) for n in named):
        experiment_name, project_name = named  # a verl that records the names in meta.json
    experiment, project = split_run_name(run, experiment_name, project_name)
    gbs, n, prompt_len, response_len = (int(g) for g in match.groups())
    return Namespace(experiment, project, gbs, n, prompt_len, response_len), step, int(inner), warnings


# -- the command -----------------------------------------------------------------------------


def import_verl(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    echo: Callable[[str], Any] = print,
    *,
    experiment_name: str | None = None,
    project_name: str | None = None,
    role: str = "rollout",
) -> ImportedSteps:
    """Convert every verl ``gen_batch.dp`` under ``src`` into a skip entry of ``role`` under ``dst``
    (and every ``tq_batch.pt`` into a part of a ``rollout_tq`` entry).

    ``dst`` is the ``skip.<role>.dump_dir`` of the run that should find the entries; each lands in
    the namespace verl's directory names (``experiment_name``/``project_name`` settle a run
    directory whose name splits more than one way). One line is echoed per step, its control
    characters escaped (paths and reasons come from the dump); a dump that cannot be converted is
    reported and skipped. Returns the step directories written, with the failures in ``.failed``.
    """

    def say(line: str) -> None:
        echo(printable(line))

    src, dst = Path(src), Path(dst)
    written = ImportedSteps()
    sources: dict[Path, Path] = {}  # destination entry -> the dump imported into it
    dumps = 0
    for dump in find_dumps(src):
        dumps += 1
        try:
            path, line = _import_step(dump, dst, role, (experiment_name, project_name), sources, say)
        except Exception as exc:  # one bad dump must not stop the others
            reason = printable(str(exc) or type(exc).__name__)
            written.failed.append((dump, reason))
            say(f"error: {dump}: {reason}")
            continue
        sources[path] = dump
        written.append(path)
        say(line)
    if not dumps:
        say(f"no {GEN_BATCH} or {TQ_BATCH} found under {src}")
    elif written.failed:
        say(f"{len(written.failed)} of {dumps} verl dumps could not be imported")
    return written


def _import_step(
    dump: Path,
    dst: Path,
    role: str,
    names: tuple[str | None, str | None],
    sources: Mapping[Path, Path],
    echo: Callable[[str], Any],
) -> tuple[Path, str]:
    """Store one dump as the skip entry its layout names; returns it and the line reporting it.

    ``sources`` (entry -> dump) holds what this import wrote: two dumps of one namespace and step
    (one run dumped twice, under two ``dump_dir``s) must not silently overwrite each other.
    """
    namespace, step, inner, warnings = target_of(dump, *names)
    for warning in warnings:
        echo(f"warning: {dump}: {warning}")
    if dump.name == TQ_BATCH:
        batch, _ = read_tq_batch(dump)
        store = CacheStore(dst, namespace, role="rollout_tq").generation(inner)
    else:
        batch = read_gen_batch(dump)
        store = CacheStore(dst, namespace, role=role)
    target = store.path(step)
    if target.resolve() == dump.parent.resolve():
        raise VerlDumpError("the destination entry is this verl step directory; choose another DST")
    if target in sources:
        raise VerlDumpError(f"{sources[target]} was already imported into {target} (same namespace and step)")
    replaced = target.exists()
    path = store.save(step, batch, fingerprint=None)
    note = ", replaced the existing entry" if replaced else ""
    return path, f"{dump} -> {path} ({len(batch)} samples, step {step}{note})"
