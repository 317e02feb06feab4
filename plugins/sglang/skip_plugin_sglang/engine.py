"""The ``sglang`` rollout backend: one SGLang ``Engine`` per rollout worker, on CUDA.

The engine runs its scheduler in child processes; its tokenizer manager lives in this process
and serves the event loop of its first request for good. As in the vllm backend, that loop is
the backend's own, in a thread, so callers may use any loop and cancelling one aborts its request.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from skip_core.backend import FinishReason, Generation, RolloutBackend, SamplingParams
from skip_core.loop_thread import LoopThread

from skip_plugin_sglang.options import SGLangOptions

FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangBackend(RolloutBackend):
    """``engine`` is SGLang's ``Engine``, public for inspection and benchmarks."""

    def __init__(self, options: SGLangOptions, model_dir: Path):
        import sglang

        self.options = options
        self.engine = sglang.Engine(**options.engine_args(model_dir))
        self._loop = LoopThread("skip-sglang")
        self._calls = itertools.count()  # SGLang ids must be unique; a request's turns reuse ours
        self._closed = False

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str) -> list[Generation]:
        if self._closed:
            raise RuntimeError(f"sglang backend: request {request_id!r} after shutdown()")
        if not prompt_ids:
            raise ValueError(f"sglang backend: request {request_id!r} has an empty prompt")
        rid = f"{request_id}-{next(self._calls)}"
        call = self.engine.async_generate(
            input_ids=[int(t) for t in prompt_ids], sampling_params=_sampling(params), return_logprob=True, rid=rid
        )
        try:
            outputs = await self._loop.run_async(call)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise RuntimeError(f"sglang backend: request {request_id!r}: {exc}") from exc
        outputs = outputs if isinstance(outputs, list) else [outputs]
        return [_generation(output, request_id) for output in outputs]

    async def update_weights(self, buckets: AsyncIterable[Mapping[str, Any]]) -> None:
        if self._closed:
            raise RuntimeError("sglang backend: update_weights after shutdown()")
        async for bucket in buckets:
            await self._load(bucket)

    async def _load(self, bucket: Mapping[str, Any]) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        named = [(name, tensor.detach()) for name, tensor in bucket.items()]
        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(named) for _ in range(self.options.tp_size)],
            load_format=None,
            flush_cache=True,  # cached prefixes hold keys and values of the old weights
        )
        result = await self._manager("update_weights_from_tensor", request, None)
        success, message = result[:2] if isinstance(result, tuple) else (result.success, result.message)
        if not success:
            raise RuntimeError(f"sglang backend: update_weights failed: {message}")

    async def sleep(self) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        if self.options.enable_memory_saver:
            await self._manager("release_memory_occupation", ReleaseMemoryOccupationReqInput(), None)

    async def wake_up(self) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        if self.options.enable_memory_saver:
            await self._manager("resume_memory_occupation", ResumeMemoryOccupationReqInput(), None)

    async def pause(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        # "abort": requests running return what they have, finish reason abort.
        await self._manager("pause_generation", PauseGenerationReqInput(mode="abort"))

    async def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self._manager("continue_generation", ContinueGenerationReqInput())

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.pause()  # requests in flight end with "abort" instead of waiting forever
        await asyncio.to_thread(self.engine.shutdown)
        self._loop.stop()

    async def _manager(self, method: str, *args: Any) -> Any:
        return await self._loop.run_async(getattr(self.engine.tokenizer_manager, method)(*args))


def _sampling(params: SamplingParams) -> dict[str, Any]:
    sampling = {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "no_stop_trim": True,  # the completion keeps the tokens that completed a stop string
    }
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    return sampling


def _generation(output: Mapping[str, Any], request_id: str) -> Generation:
    meta = output["meta_info"]
    reason = FINISH_REASONS.get((meta.get("finish_reason") or {}).get("type"))
    if reason is None:
        raise RuntimeError(f"sglang backend: request {request_id!r} finished with {meta.get('finish_reason')!r}")
    entries = meta["output_token_logprobs"]  # (log-prob, token id, text) per sampled token
    return Generation([int(e[1]) for e in entries], [float(e[0]) for e in entries], reason)
