"""Sharded loading in ``ranks`` fresh processes (gloo on 127.0.0.1): each builds the real ``Policy``
(and its reference), a LoRA policy or the ``Critic`` from ``model`` (``kind``), reports its peak
host memory while building against the bytes of its shards, and rank 0 checks every gathered
weight against the model loaded whole (the policy: the files; the others: the same class built on
one rank, before the group exists, so that new heads and adapters are compared too).
Run by ``test_loading.py``: ``python loading_probe.py '<options as JSON>' OUT_DIR``."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path


def kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def build(options: dict, kind: str, group):
    """The trained model of ``kind`` on ``group`` (None: one rank, loaded whole)."""
    from skip_plugin_trainer.config.algorithm import ActorConfig, CriticConfig
    from skip_plugin_trainer.config.sections import ModelConfig
    from skip_plugin_trainer.train.critic import Critic
    from skip_plugin_trainer.train.policy import Policy

    if kind == "critic":
        return Critic(options["model"], CriticConfig(), samples_per_prompt=1, seed=3, group=group, device="cpu")
    lora = ModelConfig(lora_rank=4, target_modules="all-linear") if kind == "lora" else None
    return Policy(
        options["model"], ActorConfig(use_kl_loss=options["reference"]), samples_per_prompt=1, seed=3,
        use_reference=options["reference"], model_config=lora, group=group, device="cpu",
    )  # fmt: skip


def rank_main(rank: int, world: int, address: str, options: dict, out: str) -> None:
    import torch
    from skip_plugin_trainer.train.distributed import Group, full
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(options["model"]))]  # its modules imported first
    kind = options.get("kind", "policy")
    whole = None
    if rank == 0 and kind != "policy":
        whole = {n: t.detach().clone() for n, t in build(options, kind, None).model.state_dict().items()}
    before = kib("VmRSS")
    trained = build(options, kind, Group(rank, world, address))
    peak = kib("VmHWM") - before
    shards = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in trained.model.parameters()
    )
    models = {"model": trained.model} | ({"reference": trained.reference} if options["reference"] else {})
    gathered = {kind: {n: full(t).detach().clone() for n, t in m.state_dict().items()} for kind, m in models.items()}
    differing: list[str] = []
    if rank == 0:
        from transformers import AutoModelForCausalLM

        if whole is None:
            whole = AutoModelForCausalLM.from_pretrained(options["model"], dtype=torch.float32).state_dict()
        for part, tensors in gathered.items():
            differing += [f"{part}.{n}" for n, t in tensors.items() if not torch.equal(t, whole[n])]
        differing += [f"missing {n}" for n in whole if n not in gathered["model"]]
    from torch.distributed.fsdp import FSDPModule

    result = {
        "peak": peak, "shards": shards, "differing": differing,
        "sharded": isinstance(next(trained.model.parameters()), DTensor),
        "units": sum(isinstance(module, FSDPModule) for module in trained.model.modules()),
    }  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    options, out = json.loads(sys.argv[1]), sys.argv[2]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    mp.spawn(rank_main, args=(options["ranks"], address, options, out), nprocs=options["ranks"], join=True)


if __name__ == "__main__":
    main()
