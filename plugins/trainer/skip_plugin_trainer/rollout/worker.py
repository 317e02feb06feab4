"""``RolloutWorker``: the Ray actor of one rollout worker, its agent loop and backend built in the
worker process from the run's settings; ``RolloutGroup`` (``group.py``) is the driver's handle on them."""

from __future__ import annotations

import os

from skip_core import spans
from skip_core.batch import Batch
from skip_core.schedule import GLOBAL_STEPS
from skip_core.weight_group import Layout, Receiver, WeightGroup

from skip_plugin_trainer.actors import Located
from skip_plugin_trainer.config.settings import RolloutSettings
from skip_plugin_trainer.rollout.weights import Bucket, unpack


class RolloutWorker(Located):
    """One agent loop and backend, built in the worker process from the run's settings.

    ``rank`` names the worker in profiles; spans of work outside a rollout (weight loads)
    carry the step of the last batch it generated. ``devices``: the GPUs (``CUDA_VISIBLE_DEVICES``)
    of an engine whose tensor-parallel shards share them with the actor ranks (``placement.py``);
    Ray shows a worker only its own bundle's, the first of them.
    """

    def __init__(self, settings: RolloutSettings, threads: int, rank: int, devices: str | None = None) -> None:
        if devices is not None:  # before anything initialises CUDA; the engine's shard processes inherit it
            os.environ["CUDA_VISIBLE_DEVICES"] = devices
        import torch
        from transformers.utils import logging as hf_logging

        from skip_plugin_trainer.rollout.parts import RolloutParts, load_tokenizer

        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads)
        spans.configure(settings.sections, worker=rank)
        self.loop = RolloutParts.from_settings(settings).agent_loop(settings, load_tokenizer(settings))
        self.step = 0

    def generate_sequences(self, prompts: Batch) -> Batch:
        self.step = int(prompts.meta_info.get(GLOBAL_STEPS, self.step))
        return self.loop.generate_sequences(prompts)

    def load_weights_bucket(self, bucket: Bucket, index: int, count: int, version: int, interrupt: bool) -> None:
        with spans.span("weight_sync", step=self.step, bucket=index):
            self.loop.load_weights_bucket(unpack(bucket), index, count, version, interrupt)

    def receiver(self) -> Receiver | None:
        return self.loop.backend.receiver()

    def join_weight_group(self, group: WeightGroup, rank_offset: int) -> None:
        self.loop.join_weight_group(group, rank_offset)

    def receive_weights(self, layouts: list[Layout], version: int, interrupt: bool) -> None:
        with spans.span("weight_sync", step=self.step, buckets=len(layouts), via="group"):
            self.loop.receive_weights(layouts, version, interrupt)

    def engine_counters(self) -> dict[str, float]:
        return self.loop.backend.counters()

    def sleep(self, keep_weights: bool = True) -> None:
        with spans.span("engine_sleep", step=self.step):
            self.loop.sleep(keep_weights)

    def wake_up(self, part: str | None = None) -> None:
        with spans.span("engine_wake", step=self.step, part=part or "all"):
            self.loop.wake_up(part)

    def shutdown(self) -> None:
        """Stop the engine and write out the spans still buffered (``ray.kill`` would lose them)."""
        try:
            self.loop.shutdown()
        finally:
            spans.close()
