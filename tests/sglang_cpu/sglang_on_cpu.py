"""SGLang 0.5.23 on this project's CPU, for the test suite only (see README.md beside this file).

Imported at start (``sitecustomize``) by every process that has this folder on ``PYTHONPATH``:
the test process, the engine's scheduler and detokenizer processes, Ray's workers. It changes
nothing until SGLang itself is imported (a filter on one of SGLang's loggers aside); then it
adapts the places where SGLang's CPU path meets what this machine lacks, each named below.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Callable


def _stand_in_torchvision() -> dict[str, types.ModuleType]:
    """The names SGLang's vision-model configs import from torchvision at module level. PyPI's
    torchvision is a CUDA build that fails to import beside the CPU torch; text generation never
    calls these. They exist only while those two modules load, so nothing else (transformers,
    which probes for torchvision) ever sees a torchvision."""

    def absent(*args, **kwargs):
        raise NotImplementedError("torchvision is not installed: the CPU setup has no image transforms")

    functional = types.ModuleType("torchvision.transforms.functional")
    functional.InterpolationMode = enum.Enum("InterpolationMode", "NEAREST BILINEAR BICUBIC")
    transforms = types.ModuleType("torchvision.transforms")
    transforms.__getattr__ = lambda name: absent
    transforms.functional = functional
    transforms.InterpolationMode = functional.InterpolationMode
    torchvision = types.ModuleType("torchvision")
    torchvision.transforms = transforms
    return {m.__name__: m for m in (torchvision, transforms, functional)}


def _load_with_torchvision(load: Callable[[], None]) -> None:
    stand_ins = _stand_in_torchvision()
    sys.modules.update(stand_ins)
    try:
        load()
    finally:
        for name in stand_ins:
            sys.modules.pop(name, None)


def _deterministic_torch_native(module: types.ModuleType) -> None:
    """Seeded sampling needs ``enable_deterministic_inference``, whose attention backends are GPU
    ones; ``torch_native``, the CPU's, is added through SGLang's own extension point."""
    module.add_deterministic_attention_backend_choices(["torch_native"])


def _no_batch_invariant_kernels(module: types.ModuleType) -> None:
    """Deterministic inference also swaps in batch-invariant matmul kernels, written in Triton for
    CUDA and XPU only; on CPU they are left out (the seeds still hold whatever shares the batch:
    the tests check it)."""
    module.ModelRunner.maybe_enable_batch_invariant_mode = lambda self: None


class _QuietModelRegistry(logging.Filter):
    """SGLang imports every model class at start and warns, one line each, of those whose kernels
    are not here (a dozen, none of them a model the tests load). Set before the registry loads,
    since it warns while it loads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Ignore import error when loading")


logging.getLogger("sglang.srt.models.registry").addFilter(_QuietModelRegistry())


AROUND: dict[str, Callable] = {
    "sglang.srt.configs.deepseek_ocr": _load_with_torchvision,
    "sglang.srt.multimodal.internvl_utils": _load_with_torchvision,
}
AFTER: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.arg_groups.choices": _deterministic_torch_native,
    "sglang.srt.model_executor.model_runner": _no_batch_invariant_kernels,
}


class _Adapted(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, name: str):
        self.loader, self.name = loader, name

    def __getattr__(self, name):  # get_source, get_filename...: inspect and torch.compile read them
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        around = AROUND.get(self.name)
        if around is None:
            self.loader.exec_module(module)
        else:
            around(lambda: self.loader.exec_module(module))
        if self.name in AFTER:
            AFTER[self.name](module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in AROUND and name not in AFTER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Adapted(spec.loader, name)
        return spec


sys.meta_path.insert(0, _Finder())
