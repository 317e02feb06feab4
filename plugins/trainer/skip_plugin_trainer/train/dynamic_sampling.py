"""DAPO's dynamic sampling (``algorithm.filter_groups``): a group whose samples all score alike
has advantage 0 everywhere and teaches nothing, so it is dropped, and more prompts are generated
until the step has ``data.train_batch_size`` groups that vary.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from skip_core.batch import Batch
from skip_core.config import ConfigError
from skip_core.manager import SkipManager

from skip_plugin_trainer.config.algorithm import FilterGroups


def varied_groups(batch: Batch, metric: str) -> np.ndarray:
    """Per sample, whether its group (``uid``) is kept: its metric varies, or it is alone."""
    if metric == "seq_reward":
        values = batch.batch["token_level_scores"].sum(-1).numpy()
    else:  # "acc" (verl's name) and "score": the reward function's own score
        values = np.asarray(batch.non_tensor_batch["score"], dtype=np.float64)
    uids = batch.non_tensor_batch["uid"]
    keep = {uid: len(set(values[uids == uid].tolist())) > 1 or (uids == uid).sum() == 1 for uid in set(uids)}
    return np.array([keep[uid] for uid in uids], dtype=bool)


def fill(
    batch: Batch,
    config: FilterGroups,
    *,
    prompts_wanted: int,
    samples_per_prompt: int,
    score: Callable[[Batch], None],
    generate: Callable[[int], Batch],
    step: int,
) -> tuple[Batch, dict[str, float]]:
    """The step's batch of ``prompts_wanted`` varied groups, from ``batch`` (generation 0) and as
    many more generations (``generate(index)``) as it takes; ``score`` adds the rewards the
    filter reads. Each generation is its own skip entry, in order (``generation_scope``)."""
    kept: list[Batch] = []
    found = dropped = generations = 0
    while True:
        with SkipManager.generation_scope(generations):
            if generations:
                batch = generate(generations)
            score(batch)
        generations += 1
        keep = varied_groups(batch, config.metric)
        kept.append(batch[keep])
        found += int(keep.sum()) // samples_per_prompt
        dropped += int((~keep).sum()) // samples_per_prompt
        if found >= prompts_wanted:
            break
        if 0 < config.max_num_gen_batches <= generations:
            raise ConfigError(
                f"algorithm.filter_groups.max_num_gen_batches: {generations} generations of step {step} found "
                f"{found} of the {prompts_wanted} prompts with varied {config.metric} that data.train_batch_size "
                "asks for; raise it (0: no limit) or use easier data"
            )
    merged = Batch.concat(kept)[: prompts_wanted * samples_per_prompt]
    metrics = {"train/num_gen_batches": float(generations), "train/num_filtered_prompts": float(dropped)}
    metrics["train/num_kept_prompts"] = float(found)
    return merged, metrics
