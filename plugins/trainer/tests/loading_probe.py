"""Sharded loading in ``ranks`` fresh processes (gloo on 127.0.0.1): each builds the real ``Policy``
(and its reference) from ``model``, reports its peak host memory while building against the
bytes of its shards, and rank 0 checks every gathered weight against the model loaded whole.
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


def rank_main(rank: int, world: int, address: str, options: dict, out: str) -> None:
    import torch
    from skip_plugin_trainer.algorithm_settings import ActorConfig
    from skip_plugin_trainer.train.distributed import Group, full
    from skip_plugin_trainer.train.policy import Policy
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(options["model"]))]  # its modules imported first
    before = kib("VmRSS")
    config = ActorConfig(use_kl_loss=options["reference"])
    policy = Policy(
        options["model"], config, samples_per_prompt=1, use_reference=options["reference"],
        group=Group(rank, world, address), device="cpu",
    )  # fmt: skip
    peak = kib("VmHWM") - before
    shards = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in policy.model.parameters()
    )
    models = {"model": policy.model} | ({"reference": policy.reference} if options["reference"] else {})
    gathered = {kind: {n: full(t).detach().clone() for n, t in m.state_dict().items()} for kind, m in models.items()}
    differing: list[str] = []
    if rank == 0:
        from transformers import AutoModelForCausalLM

        whole = AutoModelForCausalLM.from_pretrained(options["model"], dtype=torch.float32).state_dict()
        for kind, tensors in gathered.items():
            differing += [f"{kind}.{n}" for n, t in tensors.items() if not torch.equal(t, whole[n])]
        differing += [f"missing {n}" for n in whole if n not in gathered["model"]]
    result = {"peak": peak, "shards": shards, "differing": differing, "sharded": isinstance(
        next(policy.model.parameters()), DTensor
    )}  # fmt: skip
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
