"""What runs inside vLLM's worker processes, mixed into each worker by ``worker_extension_cls``."""

from __future__ import annotations


class WeightLoader:
    """Loads the trainer's weights in place.

    ``collective_rpc`` ships its arguments with msgpack, which turns a dict of tensors into nested
    lists: the weights come as a safetensors file in shared memory, read memory-mapped.
    ``reload_weights`` (not ``model.load_weights``) re-runs the post-load processing, which the CPU
    kernels need because they repack weights after loading; it also fuses QKV and gate/up as a
    checkpoint load does.
    """

    def skip_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        tensors = load_file(path)
        model = self.model_runner.get_model()
        embedding = _tied_embedding(model)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        if embedding is not None:
            _retie(model.lm_head, embedding)
        return len(tensors)


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
