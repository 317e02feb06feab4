"""The ``hf`` rollout backend: concurrent requests decoded together with a KV cache, batched continuously.

An engine task on the event loop runs the batch one forward pass at a time. Between two passes,
the rows that arrived meanwhile are prefilled together and join the batch (up to
``max_batch_size`` rows; a request with ``n`` samples is ``n`` rows), and a row leaves the step
it finishes: a short request never waits for a long one. With ``batching: wave`` rows join only
an empty batch, as static batching does (kept for comparison). All model work runs on one
worker thread, so the event loop stays free for tool calls and new arrivals, and weight updates
land between forward passes.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import AsyncIterable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import torch
from skip_core import weight_group
from skip_core.backend import FinishReason, Generation, GuardedBackend, SamplingParams
from skip_core.weight_group import Layout, Receiver, WeightGroup
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from skip_plugin_hf.batch import Batch
from skip_plugin_hf.resolved import Resolved
from skip_plugin_hf.sampling import seeded_stream

T = TypeVar("T")


@dataclass
class EngineStats:
    """Counters for users and benchmarks.

    ``rows_per_prefill`` shows how arrivals were grouped (rows prefilled together, then joining
    the batch); ``rows_per_pass`` sums the rows of every decoding pass, so ``rows_per_pass /
    decode_passes`` is the mean batch size.
    """

    rows_per_prefill: list[int] = field(default_factory=list)
    rows_per_pass: int = 0
    decode_passes: int = 0
    forward_passes: int = 0
    forward_seconds: float = 0.0
    tokens_generated: int = 0


@dataclass(eq=False)
class _Request:
    params: SamplingParams
    future: asyncio.Future
    generations: list[Generation | None]
    pending: int


@dataclass(eq=False)
class _Row:
    """One sample of a request: the unit the engine batches."""

    request: _Request
    index: int
    prompt: list[int]
    budget: int
    stream: random.Random
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finished: bool = False


class HFBackend(GuardedBackend):
    """A transformers model serving rollout requests; ``model`` and ``stats`` are public for inspection."""

    label = "hf"

    def __init__(self, options: Resolved):
        super().__init__()
        self.options = options
        model = AutoModelForCausalLM.from_pretrained(options.model_dir, dtype=options.dtype, **options.config_overrides)
        self.model: PreTrainedModel = model.to(options.device).eval().requires_grad_(False)
        self.stats = EngineStats()
        self._max_positions: int | None = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        self._eos = _eos_token_ids(self.model)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skip-hf")
        self._queue: deque[_Row] = deque()
        self._active: list[_Row] = []  # the batch's rows, in its order; finished ones until it shrinks
        self._batch: Batch | None = None
        self._stream = random.Random()
        self._engine: asyncio.Task | None = None
        self._arrived, self._resumed, self._idle = asyncio.Event(), _event(True), _event(True)
        self._asleep = False
        self._paused = False
        self._group: Any = None  # the weight group joined, and where its buckets arrive
        self._group_device: Any = "cpu"

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """Loaded on first use: only stop strings need text."""
        return AutoTokenizer.from_pretrained(self.options.model_dir)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str) -> list[Generation]:
        self._admit(prompt_ids, request_id)
        if self._asleep:
            raise RuntimeError(f"hf backend: request {request_id!r} while asleep; call wake_up() first")
        prompt = [int(t) for t in prompt_ids]
        budget = self._budget(prompt, params, request_id)
        loop = asyncio.get_running_loop()
        self._start_engine(loop)
        request = _Request(params, loop.create_future(), [None] * params.n, params.n)
        for i in range(params.n):
            stream = self._stream if params.seed is None else seeded_stream(params.seed, i)
            self._queue.append(_Row(request, i, prompt, budget, stream))
        self._arrived.set()
        try:
            return await request.future
        except asyncio.CancelledError:
            self._queue = deque(row for row in self._queue if row.request is not request)
            raise

    def counters(self) -> dict[str, float]:
        s = self.stats
        return {
            "decode_passes": s.decode_passes,
            "decode_rows": s.rows_per_pass,
            "forward_passes": s.forward_passes,
            "forward_s": s.forward_seconds,
            "tokens": s.tokens_generated,
        }

    async def update_weights(self, buckets: AsyncIterable[Mapping[str, Any]]) -> None:
        self._refuse_if_closed("update_weights")
        async for bucket in buckets:
            await self._call(self._load, bucket)

    def receiver(self) -> Receiver:
        return Receiver(1, str(self.model.dtype).removeprefix("torch."), self.options.device.type)

    async def join_weight_group(self, group: WeightGroup, rank_offset: int) -> None:
        self._refuse_if_closed("join_weight_group")
        # Not on the model's thread: the join waits for every rank, and generating may go on meanwhile.
        pg = await asyncio.to_thread(weight_group.join, group, rank_offset)
        weight_group.leave(self._group)
        self._group, self._group_device = pg, self.options.device if group.backend == "nccl" else "cpu"

    async def receive_weights(self, layouts: Sequence[Layout]) -> None:
        self._refuse_if_closed("receive_weights")
        if self._group is None:
            raise RuntimeError("hf backend: receive_weights before join_weight_group")
        buckets = weight_group.received(self._group, layouts, self._group_device, reuse=True)  # _load copies
        while (bucket := await asyncio.to_thread(next, buckets, None)) is not None:
            await self._call(self._load, bucket)

    async def sleep(self, keep_weights: bool = True) -> None:
        if self._busy():
            raise RuntimeError("hf backend: sleep() with requests in flight; await or cancel them first")
        self._asleep = True
        if self.options.device.type == "cuda":
            await self._call(self._offload)

    async def wake_up(self, part: str | None = None) -> None:
        if part == "kv_cache":  # transformers' cache is allocated per request: nothing is held
            self._asleep = False
            return
        if self.options.device.type == "cuda":
            await self._call(self.model.to, self.options.device)
        self._asleep = part == "weights"  # generating waits for the KV cache

    async def pause(self) -> None:
        self._paused = True
        self._resumed.clear()
        await self._idle.wait()  # the running rows are aborted after the current forward pass

    async def resume(self) -> None:
        self._paused = False
        self._resumed.set()
        self._arrived.set()

    async def _close(self) -> None:
        await self.resume()  # a paused engine must still see shutdown
        engine = self._engine
        if engine is not None and not engine.done() and engine.get_loop() is asyncio.get_running_loop():
            self._arrived.set()
            await engine  # it aborts what is queued or running at the next step boundary
        else:
            self._abort(self._active + list(self._queue))
        if self.options.device.type == "cuda":
            await self._call(self._offload)
        weight_group.leave(self._group)
        self._worker.shutdown(wait=False)

    # -- engine ---------------------------------------------------------------------------

    def _start_engine(self, loop: asyncio.AbstractEventLoop) -> None:
        # One engine per event loop: a caller running asyncio.run per trainer step gets a fresh
        # engine each time (the previous loop cancelled its engine when it closed).
        if self._engine is None or self._engine.done() or self._engine.get_loop() is not loop:
            # Events bind to the loop that first waits on them: a new loop gets new ones.
            self._arrived, self._resumed, self._idle = asyncio.Event(), _event(not self._paused), _event(True)
            self._engine = loop.create_task(self._serve(), name="skip-hf-engine")

    async def _serve(self) -> None:
        try:
            while True:
                # Cleared before the flags are read: a shutdown, resume or arrival during this
                # turn's awaits then ends the wait below instead of being lost.
                self._arrived.clear()
                if self._closed:
                    break
                if self._paused:
                    self._stop_batch()
                    await self._resumed.wait()
                    continue
                if self.options.batching == "continuous" or self._batch is None:
                    rows = self._take(self.options.max_batch_size - self._running())
                    if rows:
                        await self._join(rows)
                if self._batch is not None:
                    if not (self._paused or self._closed):  # either may have come during the prefill
                        await self._decode()
                elif not self._queue:
                    self._idle.set()
                    await self._arrived.wait()
        finally:
            self._abort(self._active + list(self._queue))

    def _take(self, room: int) -> list[_Row]:
        rows: list[_Row] = []
        while self._queue and len(rows) < room:
            row = self._queue.popleft()
            if not row.request.future.done():  # cancelled, or failed in an earlier pass
                rows.append(row)
        return rows

    def _running(self) -> int:
        return sum(not row.finished for row in self._active)

    async def _join(self, rows: list[_Row]) -> None:
        """Prefill the arrivals as a batch of their own, then merge their rows into the running one."""
        self._idle.clear()
        self.stats.rows_per_prefill.append(len(rows))
        try:
            joining = await self._call(
                Batch, self.model, [r.prompt for r in rows], [r.request.params for r in rows], [r.stream for r in rows]
            )
            self._advance(rows, *await self._call(self._step, joining))
            if self._active:
                await self._shrink(all_finished=True)  # the merge copies the cache anyway
            if self._batch is None:
                self._batch, self._active = joining, rows
            else:
                await self._call(self._batch.merge, joining)
                self._active = self._active + rows
        except Exception as exc:  # only these rows fail: the running batch never saw them
            self._fail(rows, exc)
        await self._shrink()

    async def _decode(self) -> None:
        self.stats.decode_passes += 1
        self.stats.rows_per_pass += len(self._active)
        try:
            self._advance(self._active, *await self._call(self._step, self._batch))
        except Exception as exc:
            self._fail(self._active, exc)
            self._batch, self._active = None, []
        await self._shrink()

    async def _shrink(self, all_finished: bool = False) -> None:
        """Drop the finished rows once they are half the batch (with ``all_finished``, any).

        A copy of the cache now and then is cheaper than computing rows nobody reads.
        """
        keep = [i for i, row in enumerate(self._active) if not row.finished]
        if not keep:
            self._batch, self._active = None, []
        elif len(keep) <= len(self._active) // 2 or (all_finished and len(keep) < len(self._active)):
            await self._call(self._batch.select, keep)
            self._active = [self._active[i] for i in keep]

    def _stop_batch(self) -> None:
        """Paused: the running rows end with ``abort`` and the tokens they have; nothing runs until resume."""
        self._abort(self._active)
        self._batch, self._active = None, []
        self._idle.set()

    def _fail(self, rows: list[_Row], exc: Exception) -> None:
        for row in rows:
            row.finished = True
            if not row.request.future.done():
                row.request.future.set_exception(exc)

    def _step(self, batch: Batch) -> tuple[list[int], list[float]]:
        start = time.perf_counter()
        result = batch.step()
        self.stats.forward_seconds += time.perf_counter() - start
        self.stats.forward_passes += 1
        return result

    def _advance(self, rows: list[_Row], tokens: list[int], log_probs: list[float]) -> None:
        for row, token, log_prob in zip(rows, tokens, log_probs, strict=True):
            if row.finished:
                continue
            if row.request.future.done():
                row.finished = True
                continue
            row.token_ids.append(token)
            row.log_probs.append(log_prob)
            self.stats.tokens_generated += 1
            reason = self._finish_reason(row, token)
            if reason is not None:
                self._finish(row, reason)

    def _finish_reason(self, row: _Row, token: int) -> FinishReason | None:
        params = row.request.params
        if token in self._eos or token in params.stop_token_ids:
            return "stop"
        if params.stop and self._ends_with_stop_string(row.token_ids, params.stop):
            return "stop"
        if len(row.token_ids) >= row.budget:
            return "length"
        return None

    def _ends_with_stop_string(self, token_ids: list[int], stop: Sequence[str]) -> bool:
        # No stop string was in the text before this token, so a match ends in the newest tokens.
        # Each token decodes to at least one byte and a character is at most 4 bytes, so the last
        # 4 tokens per character (plus slack for a partial first character) hold any match.
        window = 4 * max(map(len, stop)) + 4
        text = self.tokenizer.decode(token_ids[-window:])
        return any(s in text for s in stop)

    def _finish(self, row: _Row, reason: FinishReason) -> None:
        row.finished = True
        request = row.request
        request.generations[row.index] = Generation(row.token_ids, row.log_probs, reason)
        request.pending -= 1
        if request.pending == 0 and not request.future.done():
            request.future.set_result(request.generations)

    def _abort(self, rows: list[_Row]) -> None:
        for row in rows:
            if not row.finished and not row.request.future.done():
                self._finish(row, "abort")

    def _busy(self) -> bool:
        return any(not row.finished and not row.request.future.done() for row in [*self._active, *self._queue])

    def _budget(self, prompt: list[int], params: SamplingParams, request_id: str) -> int:
        if self._max_positions is None:
            return params.max_new_tokens
        room = self._max_positions - len(prompt)
        if room < 1:
            raise ValueError(
                f"hf backend: request {request_id!r} has a prompt of {len(prompt)} tokens; "
                f"the model has {self._max_positions} positions"
            )
        return min(params.max_new_tokens, room)

    # -- model access, always on the worker thread ----------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    @torch.no_grad()
    def _load(self, state_dict: Mapping[str, Any]) -> None:
        targets = self.model.state_dict()
        unknown = sorted(set(state_dict) - set(targets))
        if unknown:
            raise KeyError(f"update_weights: the model has no weights named {', '.join(unknown[:5])}")
        for name, tensor in state_dict.items():
            have, want = tuple(tensor.shape), tuple(targets[name].shape)
            if have != want:
                raise ValueError(f"update_weights: {name} has shape {have}, the model's is {want}")
        for name, tensor in state_dict.items():
            targets[name].copy_(tensor)

    def _offload(self) -> None:
        self.model.to("cpu")
        torch.cuda.empty_cache()


def _eos_token_ids(model: PreTrainedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return frozenset(ids)


def _event(is_set: bool) -> asyncio.Event:
    event = asyncio.Event()
    if is_set:
        event.set()
    return event
