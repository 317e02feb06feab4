"""verl's ``fsdp_config.param_offload`` and ``optimizer_offload``: a trained model's weights (with
their gradients) and its optimizer's state live in host memory between the calls that use them,
so that a colocated engine has the GPU while it generates. A call that needs them brings them to
the device and sends them back when it returns (``resident``); nested calls move them once.

``fsdp_config.offload_policy`` is FSDP2's own (``CPUOffloadPolicy``): the shards stay on the host
and each unit is copied to the device for its forward and backward, the optimizer stepping on
the host; it needs a sharded model. On the CPU there is nowhere to move anything: every key is
a no-op there, and ``settings`` says so.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

HOST = torch.device("cpu")
Method = TypeVar("Method", bound=Callable[..., Any])


class Offload:
    """Where a model's weights and its optimizer's state are between calls; ``moves`` counts the
    transfers each way (``"weights to host"``...), which tests read."""

    def __init__(self, device: torch.device, weights: bool, optimizer: bool) -> None:
        self.device, self.weights, self.optimizer = device, weights, optimizer
        self.moves: dict[str, int] = {}
        self._depth = 0

    def park(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Send what is offloaded to the host (after the model is built, and after each call)."""
        if self.weights:
            _move(model, HOST)
            self._count("weights to host")
        if self.optimizer and optimizer is not None:
            _move_state(optimizer, HOST)
            self._count("optimizer to host")

    @contextlib.contextmanager
    def loaded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
        """The weights and optimizer state on the device for the duration (once, if nested)."""
        self._depth += 1
        try:
            if self._depth == 1:
                if self.weights:
                    _move(model, self.device)
                    self._count("weights to device")
                if self.optimizer and optimizer is not None:
                    _move_state(optimizer, self.device)
                    self._count("optimizer to device")
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.park(model, optimizer)

    def _count(self, move: str) -> None:
        self.moves[move] = self.moves.get(move, 0) + 1


def resident(method: Method) -> Method:
    """A ``TrainedModel`` method that needs its weights (and optimizer state) on the device."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.offload.loaded(self.model, self.optimizer):
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


def _move(model: torch.nn.Module, device: torch.device) -> None:
    model.to(device, non_blocking=True)  # its parameters' gradients go with them (``Module._apply``)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _move_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":  # AdamW keeps its step count on the host
                state[key] = value.to(device, non_blocking=True)
