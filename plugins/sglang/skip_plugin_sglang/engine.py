"""The ``sglang`` rollout backend: one SGLang ``Engine`` per rollout worker.

The engine runs its scheduler in child processes; its tokenizer manager lives in this process
and serves the event loop of its first request for good. As in the vllm backend, that loop is
the backend's own, in a thread, so callers may use any loop and cancelling one aborts its request.

What SGLang 0.5.23's API asks for, and this backend does:

- per-request seeds hold only with ``enable_deterministic_inference`` (otherwise SGLang ignores
  ``sampling_seed``), and in that mode a request without a seed gets a fixed one: every sample
  is therefore its own request with its own seed, drawn here when the caller gave none;
- ``update_weights_from_tensor`` and ``update_weights_from_distributed`` run only between
  ``begin_weight_update`` and ``end_weight_update``: a sync is one such session, a call per
  bucket, one cache flush at the end; over the trainer's weight group (``skip_core.weight_group``)
  each bucket is one broadcast SGLang reads as a ``flattened_bucket``;
- ``Engine`` has no ``abort_request``: a cancelled request is also aborted through the tokenizer
  manager (a no-op where the manager already dropped it);
- ``Engine.shutdown()`` SIGKILLs every child process of the process hosting the engine, and the
  handler it installs for a failed child kills that process and all its children: the backend
  ends only the engine's own processes, and puts the host's handler back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import threading
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from skip_core.backend import Generation, GuardedBackend, SamplingParams, untied
from skip_core.config import ConfigError
from skip_core.loop_thread import LoopThread
from skip_core.weight_group import Layout, Receiver, WeightGroup, named

from skip_plugin_sglang.options import SGLangOptions, on_cpu

log = logging.getLogger(__name__)
SEEDS = 2**63  # SGLang keeps seeds as int64


class SGLangBackend(GuardedBackend):
    """``engine`` is SGLang's ``Engine``, public for inspection and benchmarks."""

    label = "sglang"

    def __init__(self, options: SGLangOptions, model_dir: Path):
        super().__init__()
        self.cpu = on_cpu()
        if self.cpu:
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # read at import, here and in the scheduler processes
        import psutil
        import sglang

        self.options, self.model_dir = options, model_dir
        host = psutil.Process()
        before = {child.pid for child in host.children()}
        self._sigquit = signal.getsignal(signal.SIGQUIT)
        try:
            self.engine = sglang.Engine(**options.engine_args(model_dir, cpu=self.cpu))
        except ValueError as exc:  # SGLang's checks of its server arguments, before any process starts
            raise ConfigError(f"rollout.engine_kwargs.sglang: SGLang refused the engine's arguments: {exc}") from None
        self._processes = [child for child in host.children() if child.pid not in before]
        self._loop = LoopThread("skip-sglang")
        self._unseeded = random.Random()
        self._group: str | None = None  # the weight group joined, by name
        if not options.enable_deterministic_inference:
            log.warning(
                "sglang backend: rollout.engine_kwargs.sglang.enable_deterministic_inference=false: "
                "SGLang ignores per-request seeds, so seeded requests are not reproducible"
            )

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str) -> list[Generation]:
        self._admit(prompt_ids, request_id)
        ids = [int(t) for t in prompt_ids]
        samples = [
            asyncio.ensure_future(
                self._loop.run_async(self._one(ids, _sampling(params, seed), self._engine_id(request_id)))
            )
            for seed in self._seeds(params)
        ]
        with self._errors_of(request_id):
            try:
                outputs = await asyncio.gather(*samples)
            except BaseException:
                for sample in samples:
                    sample.cancel()  # the others would run on for nothing
                raise
        return [self._generation(output, request_id) for output in outputs]

    async def update_weights(self, buckets: AsyncIterable[Mapping[str, Any]]) -> None:
        self._refuse_if_closed("update_weights")
        async with self._weight_update():
            async for bucket in buckets:
                await self._load(bucket)

    @asynccontextmanager
    async def _weight_update(self) -> AsyncIterator[None]:
        """One weight-update session, the cache flushed after it."""
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

        await self._manager("begin_weight_update", BeginWeightUpdateReqInput(), None)
        try:
            yield
        finally:
            await self._manager("end_weight_update", EndWeightUpdateReqInput(), None)
        await self._manager("flush_cache")  # cached prefixes hold keys and values of the old weights

    async def _load(self, bucket: Mapping[str, Any]) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        named = [(name, tensor.detach()) for name, tensor in untied(bucket).items()]
        payload = MultiprocessingSerializer.serialize(named)  # one per TP rank: each takes its own
        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[payload] * self.options.tp_size, load_format=None, flush_cache=False
        )
        success, message = _outcome(await self._manager("update_weights_from_tensor", request, None))
        if not success:
            raise RuntimeError(f"sglang backend: update_weights failed: {message}")

    def receiver(self) -> Receiver:
        dtype = str(self.engine.tokenizer_manager.model_config.dtype).removeprefix("torch.")
        return Receiver(self.options.tp_size, dtype, "cpu" if self.cpu else "cuda")

    async def join_weight_group(self, group: WeightGroup, rank_offset: int) -> None:
        from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput, InitWeightsUpdateGroupReqInput

        self._refuse_if_closed("join_weight_group")
        request = InitWeightsUpdateGroupReqInput(
            master_address=group.address,
            master_port=group.port,
            rank_offset=rank_offset,
            world_size=group.world_size,
            group_name=group.name,
            backend=group.backend,
        )
        success, message = _outcome(await self._manager("init_weights_update_group", request, None))
        if not success:
            raise RuntimeError(f"sglang backend: joining the weight group failed: {message}")
        if self._group is not None:  # the group of before, whose other ranks have left it
            leaving = DestroyWeightsUpdateGroupReqInput(group_name=self._group)
            await self._manager("destroy_weights_update_group", leaving, None)
        self._group = group.name

    async def receive_weights(self, layouts: Sequence[Layout]) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        self._refuse_if_closed("receive_weights")
        if self._group is None:
            raise RuntimeError("sglang backend: receive_weights before join_weight_group")
        async with self._weight_update():
            for layout in layouts:  # one broadcast per bucket: the layout SGLang calls a flattened bucket
                request = UpdateWeightsFromDistributedReqInput(
                    **named(layout), group_name=self._group, flush_cache=False, load_format="flattened_bucket"
                )
                success, message = _outcome(await self._manager("update_weights_from_distributed", request, None))
                if not success:
                    raise RuntimeError(f"sglang backend: receive_weights failed: {message}")

    async def sleep(self, keep_weights: bool = True) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        # the memory saver releases weights and KV cache alike; a sync then loads every weight
        if self._memory_saver():
            await self._manager("release_memory_occupation", ReleaseMemoryOccupationReqInput(), None)

    async def wake_up(self, part: str | None = None) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        if self._memory_saver():
            request = ResumeMemoryOccupationReqInput(tags=None if part is None else [part])
            await self._manager("resume_memory_occupation", request, None)

    async def pause(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        # "abort": requests running return what they have, finish reason abort; new ones wait for continue.
        await self._manager("pause_generation", PauseGenerationReqInput(mode="abort"))

    async def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self._manager("continue_generation", ContinueGenerationReqInput())

    async def _close(self) -> None:
        await self.pause()  # requests in flight end with "abort" instead of waiting forever
        await asyncio.to_thread(self._shutdown_engine)
        self._loop.stop()
        if threading.current_thread() is threading.main_thread() and self._sigquit is not None:
            signal.signal(signal.SIGQUIT, self._sigquit)  # SGLang's handler for a failed child kills this process

    def _shutdown_engine(self) -> None:
        """``Engine.shutdown()`` with its last step, ``kill_process_tree(os.getpid())``, confined to
        the engine's processes: in a process it shares (a Ray driver's, a test's), that step
        killed Ray's own processes and every other child with them."""
        from sglang.srt.entrypoints import engine as module

        blanket = module.kill_process_tree

        def engine_processes_only(parent_pid, include_parent=True, **kwargs):
            for process in self._processes:
                blanket(process.pid, include_parent=True, **kwargs)

        module.kill_process_tree = engine_processes_only
        try:
            self.engine.shutdown()
        finally:
            module.kill_process_tree = blanket

    async def _one(self, ids: list[int], sampling: dict[str, Any], rid: str) -> Mapping[str, Any]:
        """One sample, on the engine's loop."""
        try:
            call = self.engine.async_generate(input_ids=ids, sampling_params=sampling, return_logprob=True, rid=rid)
            return await call
        except asyncio.CancelledError:
            self.engine.tokenizer_manager.abort_request(rid=rid)  # not left to the manager's own cleanup
            raise

    def _seeds(self, params: SamplingParams) -> list[int]:
        """Sample i of a seeded request draws from ``(seed, i)``; unseeded samples from fresh seeds."""
        if params.seed is None:
            return [self._unseeded.randrange(SEEDS) for _ in range(params.n)]
        return [(params.seed * 1_000_003 + i) % SEEDS for i in range(params.n)]

    def _memory_saver(self) -> bool:
        why = "on CPU SGLang's memory saver does not exist" if self.cpu else "enable_memory_saver=false"
        return self._sleeps(self.options.enable_memory_saver and not self.cpu, why)

    def _generation(self, output: Mapping[str, Any], request_id: str) -> Generation:
        meta = output["meta_info"]
        reason = self._finish_reason((meta.get("finish_reason") or {}).get("type"), request_id)
        entries = meta["output_token_logprobs"]  # (log-prob, token id, text) per sampled token
        return Generation([int(e[1]) for e in entries], [float(e[0]) for e in entries], reason)

    async def _manager(self, method: str, *args: Any) -> Any:
        return await self._loop.run_async(getattr(self.engine.tokenizer_manager, method)(*args))


def _sampling(params: SamplingParams, seed: int) -> dict[str, Any]:
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "no_stop_trim": True,  # the completion keeps the tokens that completed a stop string
        "sampling_seed": seed,
    }


def _outcome(result: Any) -> tuple[bool, str]:
    return tuple(result[:2]) if isinstance(result, tuple) else (result.success, result.message)
