"""The multi-turn agent loop: one state machine per request, many requests in flight.

Each sample of each prompt is a request that moves PENDING -> RUNNING -> (TOOL_CALLING ->
RUNNING)* -> COMPLETED | FAILED. A RUNNING request checks its length limits, asks the
backend for one assistant turn, and either ends (no tool call, a length stop, ``max_turns``)
or runs the turn's tool calls concurrently and goes on. The model's sampled ids are kept as
they are (loss mask 1, with their log-probs); tool responses are rendered by the chat
template and masked out (loss mask 0).

A tool that raises or times out answers with the error text, as a real environment would.
A backend error or timeout fails the request, cancels the rest of the batch and raises
``RolloutError`` naming the request: a rollout never hangs and never returns half a batch.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from skip_core import spans
from skip_core.backend import FinishReason, Generation, RolloutBackend, SamplingParams
from skip_core.batch import Batch
from skip_core.loop_thread import LoopThread
from skip_core.manager import SkipManager
from skip_core.schedule import GLOBAL_STEPS, GREEDY, INDEX_BASE, VALIDATE
from skip_core.weight_group import Layout, WeightGroup

from skip_plugin_trainer.config.sections import LoopConfig, Sampling
from skip_plugin_trainer.data.chat import ChatFormat
from skip_plugin_trainer.rollout.padding import ROLLOUT_LAYOUT, pad_requests
from skip_plugin_trainer.rollout.request import Request, State
from skip_plugin_trainer.rollout.stats import rollout_stats
from skip_plugin_trainer.rollout.tools import Tool, ToolCall, ToolParser, ToolResponse
from skip_plugin_trainer.rollout.weights import EngineWeights

T = TypeVar("T")


class RolloutError(RuntimeError):
    """A request failed (backend error or timeout); the batch it belonged to is not returned."""


class AgentLoop:
    """Rolls out prompt batches on a backend; owns the event loop the backend runs on.

    The loop runs in a daemon thread so synchronous trainers and asyncio callers (streaming
    rollout, from any event loop) share one engine.
    """

    def __init__(
        self,
        backend: RolloutBackend,
        tokenizer: Any,
        config: LoopConfig,
        tools: Mapping[str, Tool] | None = None,
        parser: ToolParser | None = None,
    ) -> None:
        self.backend, self.tokenizer, self.config = backend, tokenizer, config
        self.chat = ChatFormat(tokenizer, config.chat_template_kwargs)
        self.tools = dict(tools or {})
        self.parser = parser
        self.rollouts = 0  # batches really generated: a skip cache hit never reaches the loop
        self.on_request: Callable[[], None] | None = None  # told each time a request ends (progress)
        self.weights = EngineWeights(backend)
        self._loop = LoopThread("skip-agent-loop")

    # -- public entry points: the units skip roles replace --------------------------------

    @SkipManager.annotate(role="rollout", layout=ROLLOUT_LAYOUT)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """Roll out every prompt of the batch (``n`` samples each) and return them padded."""
        return self._loop.run(self._generate(prompts, sample_key=None))

    @SkipManager.annotate(role="async_rollout", layout=ROLLOUT_LAYOUT)
    async def generate_sequences_single(self, prompts: Batch, sample_id: str) -> Batch:
        """Roll out one streamed prompt; ``sample_id`` (``sample_{epoch}_{index}``) seeds it."""
        return await self._loop.run_async(self._generate(prompts, sample_key=sample_id))

    def update_weights(self, state_dict: Mapping[str, Any], version: int = 0, interrupt: bool = False) -> None:
        """Load the trainer's weights of step ``version``, whole. ``interrupt``: pause the engine
        under the requests in flight (they continue from their tokens so far with these weights)
        instead of requiring that none runs."""
        self.load_weights_bucket(state_dict, 0, 1, version, interrupt)

    def load_weights_bucket(
        self, bucket: Mapping[str, Any], index: int, count: int, version: int, interrupt: bool
    ) -> None:
        """Bucket ``index`` of ``count`` of the weights of step ``version``: the first starts the
        backend's load (pausing it, with ``interrupt``), the last finishes it. Returns once the
        backend is done with the bucket, which the caller may then free."""
        self._loop.run(self.weights.load_bucket(bucket, index, count, version, interrupt))

    def join_weight_group(self, group: WeightGroup, rank_offset: int) -> None:
        self._loop.run(self.backend.join_weight_group(group, rank_offset))

    def receive_weights(self, layouts: Sequence[Layout], version: int = 0, interrupt: bool = False) -> None:
        """The weights of step ``version`` over the joined weight group, as ``update_weights`` loads them."""
        self._loop.run(self.weights.receive(layouts, version, interrupt))

    def sleep(self, keep_weights: bool = True) -> None:
        self._loop.run(self.backend.sleep(keep_weights))

    def wake_up(self, part: str | None = None) -> None:
        self._loop.run(self.backend.wake_up(part))

    def shutdown(self) -> None:
        """Stop the backend, then the loop thread; the agent loop is unusable afterwards."""
        if self._loop.stopped:
            return
        try:
            self._loop.run(self.backend.shutdown())
        finally:
            self._loop.stop()

    # -- one batch ----------------------------------------------------------------------

    async def _generate(self, prompts: Batch, sample_key: str | None) -> Batch:
        self.rollouts += 1
        validate = bool(prompts.meta_info.get(VALIDATE, False))
        sampling = self.config.val_kwargs if validate else self.config
        if prompts.meta_info.get(GREEDY):  # a baseline's one greedy response per prompt (ReMax's)
            sampling = Sampling(n=1, temperature=0.0)
        key = sample_key if sample_key is not None else f"step{prompts.meta_info.get(GLOBAL_STEPS, 0)}"
        # A worker given rows [base, base + len) of a split batch seeds them as the whole batch would.
        base = int(prompts.meta_info.get(INDEX_BASE, 0))
        step = int(prompts.meta_info.get(GLOBAL_STEPS, 0))
        with spans.span("rollout", step=step, phase="val" if validate else "train", requests=len(prompts) * sampling.n):
            rows = [(i, offset) for i in range(len(prompts)) for offset in range(sampling.n)]
            requests = [self._request(prompts, i, offset, key, base) for i, offset in rows]
            start = time.perf_counter()
            await self._run_all(requests, sampling)
            seconds = time.perf_counter() - start
            with spans.span("padding", requests=len(requests)):
                return self._to_batch(requests, seconds, validate)

    def _request(self, prompts: Batch, index: int, offset: int, key: str, base: int) -> Request:
        with spans.span("preprocess") as span:
            request = self._build_request(prompts, index, offset, key, base)
            span.set(request_id=request.request_id, offset=offset, prompt_tokens=len(request.prompt_ids))
        return request

    def _build_request(self, prompts: Batch, index: int, offset: int, key: str, base: int) -> Request:
        extras = prompts.non_tensor_batch
        messages = [dict(m) for m in extras["raw_prompt"][index]]
        tools_kwargs = _tools_kwargs(extras, index)
        if "raw_prompt_ids" in extras:
            prompt_ids = list(extras["raw_prompt_ids"][index])
        else:
            schemas = [self.tools[name].schema for name in tools_kwargs if name in self.tools]
            prompt_ids = self.chat.prompt_ids(messages, schemas)
        seed = None if self.config.seed is None else _derive_seed(self.config.seed, key, base + index, offset)
        return Request(index, offset, prompt_ids, messages, tools_kwargs, seed)

    async def _run_all(self, requests: list[Request], sampling: Sampling) -> None:
        """Run every request; on the first failure cancel the others and raise."""
        tasks = [asyncio.ensure_future(self._rollout(request, sampling)) for request in requests]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                raise task.exception()

    # -- one request: the state machine -------------------------------------------------

    async def _rollout(self, request: Request, sampling: Sampling) -> None:
        # prompt: the row of its batch, so a profile tells which samples answer one prompt.
        ids = {"request_id": request.request_id, "offset": request.offset, "prompt": request.batch_index}
        with spans.span("request", **ids) as span:
            await self._run_request(request, sampling)
            if self.on_request is not None:
                self.on_request()
            span.set(
                turns=request.turns,
                tool_calls=request.tool_calls,
                finish_reason=request.finish_reason,
                prompt_tokens=len(request.prompt_ids),
                response_tokens=sum(request.response_mask),
            )

    async def _run_request(self, request: Request, sampling: Sampling) -> None:
        unknown = [name for name in request.tools_kwargs if name not in self.tools]
        if unknown:
            raise RolloutError(f"request {request.batch_index}/{request.offset}: tools {unknown} are not configured")
        try:
            await self._lifecycle(request, "create")
            request.state = State.RUNNING
            while request.state is State.RUNNING:
                await self._turn(request, sampling)
        except (Exception, asyncio.CancelledError) as exc:
            request.state = State.FAILED
            request.error = request.error or repr(exc)
            raise
        finally:
            await self._finish_tools(request)
        self._truncate(request)

    async def _turn(self, request: Request, sampling: Sampling) -> None:
        """One assistant turn and the tool calls it makes, or the end of the request."""
        budget = self._budget(request)
        if request.state is not State.RUNNING:
            return
        with spans.span("turn", turn=request.turns + 1):
            await self._assistant_turn(request, sampling, budget)
            if request.state is State.TOOL_CALLING:
                await self._call_tools(request)

    def _budget(self, request: Request) -> int:
        """Tokens the next turn may generate; completes the request when no turn can start."""
        if request.turns >= self.config.multi_turn.max_turns:
            self._complete(request, "max_turns")
            return 0
        budget = min(
            self.config.response_length - len(request.response_ids), self.config.model_len - request.length - 1
        )
        if len(request.prompt_ids) > self.config.prompt_length:
            request.error = (
                f"prompt of {len(request.prompt_ids)} tokens exceeds prompt_length {self.config.prompt_length}"
            )
            raise RolloutError(f"request {request.batch_index}/{request.offset}: {request.error}")
        if budget <= 0:
            self._complete(request, "length")
        return budget

    async def _assistant_turn(self, request: Request, sampling: Sampling, budget: int) -> None:
        generation = await self._engine_call(request, sampling, budget)
        request.turns += 1
        request.extend(generation.token_ids, generation.log_probs)
        if generation.finish_reason == "length":
            return self._complete(request, "length")
        text = self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        content, calls = self._parse(text)
        request.messages.append(_assistant_message(content, calls))
        if calls:
            request.state = State.TOOL_CALLING
        else:
            self._complete(request, "stop")

    async def _engine_call(self, request: Request, sampling: Sampling, budget: int) -> Generation:
        """One turn's completion; one cut short by a weight update continues from its tokens so far."""
        ids = request.prompt_ids + request.response_ids
        where = f"request {request.batch_index}/{request.offset} (turn {request.turns + 1})"
        tokens: list[int] = []
        log_probs: list[float] = []
        while True:
            pauses = self.weights.pauses
            generation = await self._generate_once(request, sampling, ids + tokens, budget - len(tokens), where)
            tokens += generation.token_ids
            log_probs += generation.log_probs
            if generation.finish_reason != "abort":
                return Generation(tokens, log_probs, generation.finish_reason)
            if self.weights.pauses == pauses:  # not our pause: the engine gave up on the request
                request.error = "aborted by the backend"
                raise RolloutError(f"{where}: {request.error}")
            request.interruptions += 1
            if len(tokens) >= budget:
                return Generation(tokens, log_probs, "length")

    async def _generate_once(
        self, request: Request, sampling: Sampling, ids: list[int], budget: int, where: str
    ) -> Generation:
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_new_tokens=budget,
            stop=tuple(self.config.stop),
            stop_token_ids=(*self.config.stop_token_ids, self.tokenizer.eos_token_id),
            seed=None if request.seed is None else request.seed + request.turns + request.interruptions,
        )
        await self.weights.ready.wait()  # a call made during an update runs (and counts) with the new weights
        request.weight_versions.append(self.weights.version)
        try:
            with spans.span("generate", tokens_in=len(ids)) as span:
                call = self.backend.generate(ids, params, request.request_id)
                [generation] = await asyncio.wait_for(call, self.config.timeout_s)
                span.set(tokens_out=len(generation.token_ids), finish_reason=generation.finish_reason)
        except asyncio.TimeoutError:
            request.error = f"backend did not answer within timeout_s={self.config.timeout_s}"
            raise RolloutError(f"{where}: {request.error}") from None
        except Exception as exc:
            request.error = f"backend error: {exc!r}"
            raise RolloutError(f"{where}: {request.error}") from exc
        return generation

    def _parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The turn's content and its tool calls; a turn without any keeps its text as it is."""
        if self.parser is None or not self.parser.has_tool_call(text):
            return text, []
        content, calls = self.parser.parse(text)
        return (content, calls) if calls else (text, [])

    async def _call_tools(self, request: Request) -> None:
        calls = request.messages[-1]["tool_calls"]
        responses = await asyncio.gather(*(self._execute(request, call) for call in calls))
        request.tool_calls += len(calls)
        request.user_turns += 1
        request.messages.extend({"role": "tool", "content": response.text} for response in responses)
        request.extend(self.chat.tool_response_ids(request.messages[-len(calls) :]), None)
        if request.length >= self.config.model_len or len(request.response_ids) >= self.config.response_length:
            return self._complete(request, "length")
        limit = self.config.multi_turn.max_user_turns
        if limit is not None and request.user_turns >= limit:  # verl's tool agent loop ends here
            return self._complete(request, "max_turns")
        request.state = State.RUNNING

    async def _execute(self, request: Request, call: Mapping) -> ToolResponse:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        tool = self.tools.get(name) if name in request.tools_kwargs else None
        if tool is None:
            return ToolResponse(f"Error: no tool named {name!r} (available: {', '.join(request.tools_kwargs)})")
        kwargs = request.tools_kwargs[name].get("execute_kwargs", {})
        try:
            with spans.span("tool_call", tool=name):
                call = tool.execute(request.request_id, arguments, **kwargs)
                return await asyncio.wait_for(call, self.config.multi_turn.tool_timeout_s)
        except asyncio.TimeoutError:
            return ToolResponse(f"Error: {name} timed out after {self.config.multi_turn.tool_timeout_s} s")
        except Exception as exc:
            return ToolResponse(f"Error: {exc}")

    async def _lifecycle(self, request: Request, stage: str) -> None:
        await asyncio.gather(
            *(
                _timed(
                    f"tool_{stage}",
                    name,
                    getattr(self.tools[name], stage)(request.request_id, **kwargs.get(f"{stage}_kwargs", {})),
                )
                for name, kwargs in request.tools_kwargs.items()
            )
        )

    async def _finish_tools(self, request: Request) -> None:
        """``calc_reward`` then ``release`` per tool, also for a failed or cancelled request."""

        async def finish(name: str, tool: Tool, kwargs: Mapping) -> None:
            try:
                if request.state is not State.FAILED:
                    reward = tool.calc_reward(request.request_id, **kwargs.get("calc_reward_kwargs", {}))
                    request.tool_rewards[name] = float(await _timed("tool_reward", name, reward))
            finally:
                await _timed("tool_release", name, tool.release(request.request_id, **kwargs.get("release_kwargs", {})))

        await asyncio.shield(
            asyncio.gather(*(finish(n, self.tools[n], kw) for n, kw in request.tools_kwargs.items() if n in self.tools))
        )

    def _complete(self, request: Request, reason: FinishReason) -> None:
        request.finish_reason = reason
        request.state = State.COMPLETED

    def _truncate(self, request: Request) -> None:
        limit = self.config.response_length
        if len(request.response_ids) > limit:
            del request.response_ids[limit:], request.response_mask[limit:], request.log_probs[limit:]
            request.finish_reason = "length"

    # -- the batch the trainer gets -----------------------------------------------------

    def _to_batch(self, requests: list[Request], seconds: float, validate: bool) -> Batch:
        requests.sort(key=lambda r: (r.batch_index, r.offset))
        batch = pad_requests(requests, self.config.prompt_length, self.config.response_length, self.tokenizer)
        batch.meta_info["rollout"] = rollout_stats(requests, seconds, validate)
        return batch


async def _timed(event: str, tool: str, work: Awaitable[T]) -> T:
    with spans.span(event, tool=tool):
        return await work


def _tools_kwargs(extras: Mapping[str, Any], index: int) -> dict[str, dict]:
    if "tools_kwargs" not in extras:
        return {}
    value = extras["tools_kwargs"][index]
    return {str(name): dict(kwargs or {}) for name, kwargs in (value or {}).items()}


def _assistant_message(content: str, calls: list[ToolCall]) -> dict:
    if not calls:
        return {"role": "assistant", "content": content}
    tool_calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}


def _derive_seed(seed: int, key: str, index: int, offset: int) -> int:
    """A stable 31-bit seed per (run seed, step or sample id, prompt, sample); turns add to it."""
    return zlib.crc32(f"{seed}:{key}:{index}:{offset}".encode()) & 0x7FFF_FFFF
