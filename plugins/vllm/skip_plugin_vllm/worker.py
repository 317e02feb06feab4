"""What runs inside vLLM's worker processes, mixed into each worker by ``worker_extension_cls``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

ARRIVAL_TIMEOUT_S = 600  # the sender gets each bucket from the trainer, across the cluster


class WeightLoader:
    """Loads the trainer's weights in place.

    ``collective_rpc`` ships its arguments with msgpack, which turns a dict of tensors into nested
    lists: the weights come as broadcasts over the trainer's weight group, which each worker
    joins, or else as safetensors files in shared memory, one per bucket, read as they arrive.
    ``reload_weights`` (not ``model.load_weights``) re-runs the post-load processing, which
    the CPU kernels need because they repack weights after loading; it also fuses QKV and gate/up
    as a checkpoint load does, whichever buckets a layer's tensors came in.
    """

    def skip_load_weights(self, directory: str) -> int:
        from safetensors.torch import load_file

        def buckets():
            for path in _arrivals(Path(directory)):
                bucket = load_file(path)
                path.unlink()  # the sender writes the next bucket once this one is gone
                yield bucket

        return self._skip_reload(buckets())

    def skip_join_weight_group(self, group: dict, rank_offset: int) -> None:
        """This worker's place in the trainer's weight group: its rank among the engine's workers
        after the engine's offset (``skip_core.weight_group``)."""
        from skip_core import weight_group

        joined = weight_group.join(weight_group.WeightGroup(**group), rank_offset + self.rank)
        weight_group.leave(getattr(self, "_skip_group", None))
        self._skip_group = joined
        self._skip_group_device = "cpu" if group["backend"] == "gloo" else self.device

    def skip_receive_weights(self, layouts: list) -> int:
        """The buckets the group's rank 0 broadcasts, one per layout, loaded as they arrive."""
        from skip_core import weight_group

        group = getattr(self, "_skip_group", None)
        if group is None:
            raise RuntimeError("skip_receive_weights before skip_join_weight_group")
        buckets = weight_group.received(group, weight_group.layouts_of(layouts), self._skip_group_device)
        return self._skip_reload(buckets)

    def _skip_reload(self, buckets: Iterator[dict]) -> int:
        loaded = 0

        def tensors():
            nonlocal loaded
            for bucket in buckets:
                loaded += len(bucket)
                yield from bucket.items()

        model = self.model_runner.get_model()
        embedding = _tied_embedding(model)
        self.model_runner.reload_weights(weights_iterator=tensors())
        if embedding is not None:
            _retie(model.lm_head, embedding)
        return loaded


def bucket_file(directory: Path, index: int) -> Path:
    return directory / f"{index:06d}.safetensors"


def _arrivals(directory: Path) -> Iterator[Path]:
    """The bucket files in order, each once it is there, until ``end`` says there are no more."""
    for index in itertools.count():
        path, waited = bucket_file(directory, index), time.monotonic()
        while not path.exists():
            if (directory / "end").exists():
                return
            if not directory.exists():  # the sender failed and cleaned up: stop waiting at once
                raise RuntimeError(f"weight bucket {index} will not arrive: {directory} is gone")
            if time.monotonic() - waited > ARRIVAL_TIMEOUT_S:
                raise TimeoutError(f"weight bucket {index} did not arrive in {directory} in {ARRIVAL_TIMEOUT_S} s")
            time.sleep(0.002)
        yield path


def _retie(head, embedding) -> None:
    """A tied LM head gets no weights of its own in a reload: vLLM 0.32 puts back what its kernel
    held before (logging "ParallelLMHead: Failed to load weights"), and on CPU that kernel is a
    packed copy of the old embedding. Tie it to the new one and let it pack that."""
    if head.weight is not embedding.weight:
        head.tie_weights(embedding)
    head.quant_method.process_weights_after_loading(head)


def _tied_embedding(model):
    """The module whose weight the model's LM head shares, if it does."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None:
        return None
    return next((m for m in model.modules() if m is not head and getattr(m, "weight", None) is weight), None)
