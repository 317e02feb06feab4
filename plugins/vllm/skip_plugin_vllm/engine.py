"""The ``vllm`` rollout backend: one vLLM ``AsyncLLM`` per rollout worker, one engine request per call.

vLLM batches concurrent requests itself (continuous batching), so ``generate`` only translates:
token ids in, the sampled ids with their log-probs out. The engine starts in the constructor and
runs its core in a child process. Its output handler serves one event loop for good, so the
engine lives on a loop of its own, in a thread: callers may use any loop, one after another
(``asyncio.run`` per batch) or at once, and cancelling a caller's task aborts its request.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import tempfile
from collections.abc import AsyncIterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from skip_core.backend import Generation, GuardedBackend, SamplingParams, untied
from skip_core.loop_thread import LoopThread
from skip_core.weight_group import Layout, Receiver, WeightGroup

from skip_plugin_vllm.options import VLLMOptions
from skip_plugin_vllm.worker import bucket_file

SHARED_MEMORY = "/dev/shm" if os.path.isdir("/dev/shm") else None


class VLLMBackend(GuardedBackend):
    """``engine`` is vLLM's ``AsyncLLM``, public for inspection and benchmarks."""

    label = "vllm"

    def __init__(self, options: VLLMOptions, model_dir: Path):
        super().__init__()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if options.cpu_kvcache_space_gb is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(options.cpu_kvcache_space_gb)  # read by the engine process
        self.options, self.model_dir = options, model_dir
        self.sleep_mode = current_platform.is_sleep_mode_available() and options.enable_sleep_mode
        self._loop = LoopThread("skip-vllm")
        args = AsyncEngineArgs(**options.engine_args(model_dir, self.sleep_mode, cpu=current_platform.is_cpu()))
        self.engine = self._loop.run(_start(AsyncLLM, args))

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str) -> list[Generation]:
        self._admit(prompt_ids, request_id)
        # Cancelled, the engine's task is cancelled with ours, and vLLM aborts a request whose stream closes.
        with self._errors_of(request_id):
            final = await self._loop.run_async(self._final_output(prompt_ids, params, request_id))
        return [self._generation(out, request_id) for out in sorted(final.outputs, key=lambda out: out.index)]

    async def update_weights(self, buckets: AsyncIterable[Mapping[str, Any]]) -> None:
        self._refuse_if_closed("update_weights")
        # Each bucket goes through a file in shared memory, which the engine's workers read while
        # the next one is written: collective_rpc would turn tensors into lists, and pushes bytes
        # through its queues slowly. One reload takes them all, as a checkpoint load would.
        with tempfile.TemporaryDirectory(prefix="skip-vllm-weights-", dir=SHARED_MEMORY) as directory:
            rpc = self.engine.collective_rpc("skip_load_weights", args=(directory,))
            loading = asyncio.ensure_future(self._loop.run_async(rpc))
            try:
                await _write_buckets(buckets, Path(directory), loading)
                await loading
            finally:
                loading.cancel()
        # Cached prefixes hold keys and values computed with the old weights.
        await self._loop.run_async(self.engine.reset_prefix_cache())

    def receiver(self) -> Receiver:
        from vllm.platforms import current_platform

        dtype = str(self.engine.vllm_config.model_config.dtype).removeprefix("torch.")
        return Receiver(self.options.tensor_parallel_size, dtype, "cpu" if current_platform.is_cpu() else "cuda")

    async def join_weight_group(self, group: WeightGroup, rank_offset: int) -> None:
        self._refuse_if_closed("join_weight_group")
        joining = self.engine.collective_rpc("skip_join_weight_group", args=(asdict(group), rank_offset))
        await self._loop.run_async(joining)

    async def receive_weights(self, layouts: Sequence[Layout]) -> None:
        self._refuse_if_closed("receive_weights")
        plain = [[[spec.name, spec.dtype, list(spec.shape)] for spec in layout] for layout in layouts]  # msgpack's
        await self._loop.run_async(self.engine.collective_rpc("skip_receive_weights", args=(plain,)))
        await self._loop.run_async(self.engine.reset_prefix_cache())

    async def sleep(self, keep_weights: bool = True) -> None:
        if self._sleep_mode():  # level 2 discards the weights (verl's, when a sync overwrites them), 1 moves them
            await self._loop.run_async(self.engine.sleep(level=1 if keep_weights else 2))

    async def wake_up(self, part: str | None = None) -> None:
        if self._sleep_mode():
            await self._loop.run_async(self.engine.wake_up(tags=None if part is None else [part]))

    async def pause(self) -> None:
        # Requests running return what they have, finish reason "abort"; new ones wait for resume.
        if "mode" in inspect.signature(self.engine.pause_generation).parameters:
            pausing = self.engine.pause_generation(mode="abort", clear_cache=True)
        else:  # vLLM 0.12-0.14
            pausing = self.engine.pause_generation(wait_for_inflight_requests=False, clear_cache=True)
        await self._loop.run_async(pausing)

    async def resume(self) -> None:
        await self._loop.run_async(self.engine.resume_generation())

    async def _close(self) -> None:
        await self.pause()  # requests in flight end with "abort" instead of waiting forever
        await asyncio.to_thread(self.engine.shutdown)
        # Drop the engine now: AsyncLLM.__del__ shuts down again, which fails at interpreter exit.
        self.engine = None
        self._loop.stop()

    async def _final_output(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str) -> Any:
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids])
        final = None
        async for output in self.engine.generate(prompt, _sampling(params), self._engine_id(request_id)):
            final = output  # FINAL_ONLY: one output, when the request ends
        if final is None:
            raise RuntimeError("the engine ended the request without output")
        return final

    def _sleep_mode(self) -> bool:
        off = "not supported on this platform, or rollout.engine_kwargs.vllm.enable_sleep_mode=false"
        return self._sleeps(self.sleep_mode, f"sleep mode is off ({off})")

    def _generation(self, out: Any, request_id: str) -> Generation:
        reason = self._finish_reason(out.finish_reason, request_id)
        token_ids = list(out.token_ids)
        log_probs = [position[token].logprob for token, position in zip(token_ids, out.logprobs or [], strict=True)]
        return Generation(token_ids, log_probs, reason)


async def _start(engine_class: Any, args: Any) -> Any:
    """Built on the engine's loop, where vLLM starts its output handler at once."""
    return engine_class.from_engine_args(args)


def _sampling(params: SamplingParams) -> Any:
    from vllm import SamplingParams as VLLMSampling
    from vllm.sampling_params import RequestOutputKind

    return VLLMSampling(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k == -1 else params.top_k,
        max_tokens=params.max_new_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        include_stop_str_in_output=True,
        seed=params.seed,
        logprobs=0,  # the sampled token's own log-prob only
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


async def _write_buckets(buckets: AsyncIterable[Mapping[str, Any]], directory: Path, loading: asyncio.Future) -> None:
    """Bucket k as ``k.safetensors`` (renamed into place whole), once the workers took bucket
    k-1: at most two buckets wait in shared memory. ``end`` says there are no more."""
    from safetensors.torch import save_file

    index = 0
    async for bucket in buckets:
        part = directory / "part"
        tensors = {name: tensor.detach().contiguous() for name, tensor in untied(bucket).items()}
        await asyncio.to_thread(save_file, tensors, part)
        part.rename(bucket_file(directory, index))
        while bucket_file(directory, index - 1).exists() and not loading.done():
            await asyncio.sleep(0.002)
        if loading.done():
            loading.result()  # the workers' error
        index += 1
    (directory / "end").touch()
