"""One policy rank's measured peak memory in an update, beside ``memory.py``'s estimate; run as a
script in a fresh process (``test_memory.py``): ``python memory_probe.py '<options as JSON>'``.

It builds a random model of the given shape and saves it, then, in a second fresh process (so
that building leaves nothing behind), reads the resident set, builds the real ``Policy``, runs one
update (AdamW's state then exists), resets the kernel's high-water mark and runs a second; the
peak is that mark less the resident set before the model. glibc must return freed blocks
(``MALLOC_MMAP_THRESHOLD_``, set by the caller) or the peak would include its cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def build(options: dict) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**options["shape"])).save_pretrained(options["model"])


def kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(options: dict) -> dict:
    import torch
    from skip_core.batch import Batch
    from skip_plugin_trainer.config.algorithm import ActorConfig, FsdpConfig, Optim
    from skip_plugin_trainer.config.sections import ModelConfig
    from skip_plugin_trainer.memory import Plan, Shape, estimate
    from skip_plugin_trainer.train.policy import Policy

    rows, prompt, response = options["rows"], options["prompt"], options["response"]
    before = kib("VmRSS")
    config = ActorConfig(
        ppo_mini_batch_size=rows, ppo_micro_batch_size=rows, fsdp_config=FsdpConfig(dtype=options["dtype"])
    )
    config = config.model_copy(update={"optim": Optim(lr=1e-5)})
    model_config = ModelConfig(enable_gradient_checkpointing=options["checkpointing"])
    policy = Policy(options["model"], config, samples_per_prompt=1, model_config=model_config, threads=2)
    generator = torch.Generator().manual_seed(0)
    vocab = options["shape"]["vocab_size"]
    ids = torch.randint(1, vocab, (rows, prompt + response), generator=generator)
    mask = torch.ones(rows, prompt + response, dtype=torch.long)
    batch = Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": torch.arange(prompt + response).expand(rows, -1).contiguous(),
            "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:],
            "advantages": torch.randn(rows, 1, generator=generator).expand(rows, response).contiguous(),
        }
    )
    batch.batch["old_log_probs"] = policy.compute_log_prob(batch).batch["old_log_probs"]
    policy.update(batch)
    Path("/proc/self/clear_refs").write_text("5")  # the next high-water mark is the second update's
    policy.update(batch)
    plan = Plan(
        ranks=1, master="float32", compute=options["dtype"], trainable=True, reference=False,
        checkpointing=options["checkpointing"], tokens=rows * (prompt + response), responses=rows * response,
        chunk=None, entropy=False,
    )  # fmt: skip
    return {"peak": kib("VmHWM") - before, "estimate": sum(estimate(Shape.read(options["model"]), plan).values())}


if __name__ == "__main__":
    options = json.loads(sys.argv[1])
    if sys.argv[2:] == ["build"]:
        build(options)
    else:
        if not Path(options["model"], "config.json").exists():
            subprocess.run([sys.executable, __file__, sys.argv[1], "build"], check=True)
        print(json.dumps(measure(options)))
