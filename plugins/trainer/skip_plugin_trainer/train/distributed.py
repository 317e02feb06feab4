"""Data parallelism for the trained models: a torch.distributed group of Ray workers, each model
sharded over it with FSDP2, and what a rank reads and writes of the whole.

``resources.actor.workers`` ranks form one group (gloo on CPU, NCCL on GPU); every parameter,
gradient and optimizer state is split across them (``fully_shard`` on each decoder layer, an
untied embedding, and the root), and each rank trains its share of every mini-batch. A single
rank forms no group: its model is the plain one. Every rank must run the same collectives in the same order,
which the driver's ``ModelGroup`` guarantees by sending every call to all ranks at once.
"""

from __future__ import annotations

import socket
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

# A collective waits this long for a rank before failing; a lost rank stops the run much sooner
# (the driver sees its Ray actor die), so this only bounds a hang nobody noticed.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class Group:
    """One rank's place in its group: ``address`` (``host:port``) is rank 0's rendezvous."""

    rank: int
    world: int
    address: str


def free_address() -> str:
    """This node's address and a port free now, for a group's rendezvous (run on rank 0's node)."""
    import ray

    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def join(group: Group | None, device: torch.device) -> None:
    """Join the group (blocks until every rank has); nothing for a single rank."""
    if group is None or group.world == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{group.address}",
        rank=group.rank,
        world_size=group.world,
        timeout=COLLECTIVE_TIMEOUT,
    )


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def shard(model: torch.nn.Module, mixed: MixedPrecisionPolicy | None = None, host: bool = False) -> torch.nn.Module:
    """``model`` sharded with FSDP2 over the group: each decoder layer (the blocks Hugging Face
    marks ``_no_split_modules``) is one unit gathered for its forward and freed after, and so is
    an embedding no other module shares (as verl wraps it: at 7B an untied embedding is 1 GiB in
    bfloat16 that the root would hold through the pass); the root holds the rest (the head, tied
    to the embedding or not, the final norm); ``mixed``: the precision they
    compute in (``precision.py``); ``host``: FSDP2's offload, the shards kept in host memory
    (``offload.py``). A single rank: as it is."""
    if world() == 1:
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options = {"mp_policy": mixed or MixedPrecisionPolicy(), "offload_policy": OffloadPolicy()}
    if host:
        options["offload_policy"] = CPUOffloadPolicy()
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    uses = Counter(id(parameter) for _, parameter in model.named_parameters(remove_duplicate=False))
    for module in model.modules():
        alone = isinstance(module, torch.nn.Embedding) and uses[id(module.weight)] == 1
        if type(module).__name__ in blocks or alone:
            fully_shard(module, **options)
    fully_shard(model, **options)
    return model


def most(count: int) -> int:
    """The largest ``count`` of any rank (a collective; ``count`` itself on a single rank)."""
    if world() == 1:
        return count
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([count], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every rank (a collective) when it is a shard."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def own_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each tensor once: a tied LM head is the embedding under a second name,
    which engines tie again themselves and safetensors refuses (parameters and buffers are
    listed once each, under their first name)."""
    names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return {name: tensor for name, tensor in model.state_dict().items() if name in names}


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def as_float(value: Any) -> float:
    """A scalar that may be a sharded one (a gradient norm over DTensors is a DTensor)."""
    return float(full(value).item()) if isinstance(value, torch.Tensor) else float(value)
