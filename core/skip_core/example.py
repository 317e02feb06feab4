"""The job behind ``skip run`` until the trainer lands: a training-shaped loop whose rollout is
real autoregressive sampling from a small randomly initialised torch LM.

It exists to show, on any CPU, what a skip role does to a run: the first run generates and
dumps the listed steps, the next one loads them. Nothing here is a model worth training.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from skip_core import SkipManager
from skip_core.batch import Batch


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.rnn = torch.nn.GRU(hidden, hidden, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, state: torch.Tensor | None = None):
        out, state = self.rnn(self.embed(tokens), state)
        return self.head(out), state


class Rollout:
    """Samples responses for a prompts batch; ``generate_sequences`` is the skip unit."""

    def __init__(self, config: Any) -> None:
        self.response_len = int(config.data.max_response_length)
        self.n = int(config.actor_rollout_ref.rollout.n)
        torch.manual_seed(int(config.example.seed))
        self.model = TinyLM(int(config.example.vocab), int(config.example.hidden)).eval()
        self.generations = 0  # calls that really generated (a cache hit never reaches the body)

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        self.generations += 1
        prompt_ids = prompts.batch["input_ids"].repeat_interleave(self.n, dim=0)
        generator = torch.Generator().manual_seed(prompts.meta_info["global_steps"])
        with torch.no_grad():
            logits, state = self.model(prompt_ids)
            tokens, log_probs = [], []
            for _ in range(self.response_len):
                dist = torch.log_softmax(logits[:, -1], dim=-1)
                token = torch.multinomial(dist.exp(), 1, generator=generator)
                tokens.append(token)
                log_probs.append(dist.gather(1, token))
                logits, state = self.model(token, state)
        responses = torch.cat(tokens, dim=1)
        input_ids = torch.cat([prompt_ids, responses], dim=1)
        return Batch.from_dict(
            tensors={
                "prompts": prompt_ids,
                "responses": responses,
                "input_ids": input_ids,
                "attention_mask": torch.ones_like(input_ids),
                "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids).contiguous(),
                "response_mask": torch.ones_like(responses),
                "rollout_log_probs": torch.cat(log_probs, dim=1),
            },
            non_tensors={"raw_prompt": np.repeat(prompts.non_tensor_batch["raw_prompt"], self.n)},
        )


def make_prompts(config: Any, step: int) -> Batch:
    """The same prompts for the same step in every run, as a seeded dataloader would give."""
    size, length = int(config.data.train_batch_size), int(config.data.max_prompt_length)
    generator = torch.Generator().manual_seed(10_000 + step)
    ids = torch.randint(0, int(config.example.vocab), (size, length), generator=generator)
    raw = [f"prompt {step}-{i}: " + " ".join(map(str, row[:8].tolist())) for i, row in enumerate(ids)]
    return Batch.from_dict({"input_ids": ids}, {"raw_prompt": raw}, {"global_steps": step})


def run(config: Any, console: Console | None = None) -> list[dict]:
    """Run ``trainer.total_steps`` steps; return one row per step (also printed as a table)."""
    console = console or Console()
    SkipManager.init(config)
    rollout = Rollout(config)
    rows = []
    for step in range(1, int(config.trainer.total_steps) + 1):
        SkipManager.set_step(step)
        prompts = make_prompts(config, step)
        before, start = rollout.generations, time.perf_counter()
        with console.status(f"step {step}: rollout"):
            output = rollout.generate_sequences(prompts)
        seconds = time.perf_counter() - start
        generated = rollout.generations > before
        rows.append(
            {
                "step": step,
                "rollout": "generated" if generated else "loaded",
                "seconds": seconds,
                "sequences": len(output),
                "tokens": int(output.batch["response_mask"].sum()),
            }
        )
    start = time.perf_counter()
    SkipManager.flush()
    console.print(_table(config, rows, time.perf_counter() - start))
    return rows


def _table(config: Any, rows: list[dict], flush_seconds: float) -> Table:
    skip = config.skip.rollout
    title = f"skip.rollout: enable={skip.enable} action={skip.action} steps={list(skip.steps)} dump_dir={skip.dump_dir}"
    table = Table("step", "rollout", "seconds", "sequences", "response tokens", title=title)
    for row in rows:
        colour = "yellow" if row["rollout"] == "generated" else "green"
        table.add_row(
            str(row["step"]),
            f"[{colour}]{row['rollout']}[/{colour}]",
            f"{row['seconds']:.3f}",
            str(row["sequences"]),
            str(row["tokens"]),
        )
    spent = {kind: sum(r["seconds"] for r in rows if r["rollout"] == kind) for kind in ("generated", "loaded")}
    counts = {kind: sum(r["rollout"] == kind for r in rows) for kind in spent}
    table.caption = (
        f"rollout time: {counts['generated']} generated in {spent['generated']:.2f} s, "
        f"{counts['loaded']} loaded in {spent['loaded']:.3f} s; waiting for background dumps: {flush_seconds:.3f} s"
    )
    return table
