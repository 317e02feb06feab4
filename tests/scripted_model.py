"""Scripted models for tests: the test double is the *model* only.

``ScriptedBackend`` answers each turn with text a script chooses, encoded by the real
tokenizer; the loop, chat format, parser, tools and padding it drives are the real ones.
``HeldUntilPaused`` is the real ``hf`` engine whose first request waits for the first pause,
for runs on Ray (``rollout.backend=held_hf``); ``DiesAfterSyncs`` (``dying_hf``) kills its worker
process mid-generation once (``dying_group_hf``: the same, taking weights over the weight
group). Light to import: Ray workers import it at start.
"""

import asyncio
import functools
import json

from skip_core import Batch, hookimpl
from skip_core.backend import Backend, Generation, RolloutBackend, find_backend


def call(expression: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}</tool_call>"


class ScriptedBackend(RolloutBackend):
    """Answers turn ``k`` of each conversation with ``script(question, k)``.

    ``delay(question)`` seconds before answering; ``script`` may return an exception to raise
    or ``HANG`` to never answer.
    """

    HANG = object()

    def __init__(self, tokenizer, script, delay=lambda question: 0.0):
        self.tokenizer, self.script, self.delay = tokenizer, script, delay
        self.turns: dict[str, int] = {}
        self.params: list = []
        self.cancelled = 0

    async def generate(self, prompt_ids, params, request_id):
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        question = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        turn = self.turns.get(request_id, 0)
        self.turns[request_id] = turn + 1
        self.params.append(params)
        reply = self.script(question, turn)
        try:
            await asyncio.sleep(self.delay(question))
            if reply is self.HANG:
                await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if isinstance(reply, Exception):
            raise reply
        ids = [*self.tokenizer.encode(reply, add_special_tokens=False), self.tokenizer.eos_token_id]
        finish = "stop"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        return [Generation(ids, [-0.25 - 0.01 * i for i in range(len(ids))], finish)]

    async def update_weights(self, buckets):
        async for _ in buckets:
            pass

    async def sleep(self, keep_weights=True):
        pass

    async def wake_up(self, part=None):
        pass

    async def shutdown(self):
        pass


def prompts(tokenizer, questions, tools_kwargs=None, **meta) -> Batch:
    from skip_plugin_trainer.data.chat import ChatFormat

    chat = ChatFormat(tokenizer)
    messages = [[{"role": "user", "content": q}] for q in questions]
    kwargs = tools_kwargs or {"calculator": {}}
    return Batch.from_dict(
        non_tensors={
            "raw_prompt": messages,
            "raw_prompt_ids": [chat.prompt_ids(m) for m in messages],
            "tools_kwargs": [kwargs] * len(questions),
        },
        meta_info=meta,
    )


def make_loop(tokenizer, backend, tools=None, **config):
    from skip_plugin_arithmetic.calculator import Calculator
    from skip_plugin_trainer.config.sections import LoopConfig
    from skip_plugin_trainer.rollout.agent_loop import AgentLoop
    from skip_plugin_trainer.rollout.tools import HermesParser

    settings = {"prompt_length": 64, "response_length": 256, "n": 1, **config}
    tools = {"calculator": Calculator()} if tools is None else tools
    return AgentLoop(backend, tokenizer, LoopConfig(**settings), tools, HermesParser())


HELD = "held_hf"
ENGINES = ("vllm", "sglang")  # held_vllm, held_sglang: built only where the engine is installed
DYING = "dying_hf"
DYING_IN_SYNC = "dying_in_sync_hf"
# The same, taking weights over the weight group (the others take them through the object store).
DYING_GROUP = "dying_group_hf"
DYING_IN_GROUP_SYNC = "dying_in_group_sync_hf"


class HeldUntilPaused(RolloutBackend):
    """A real engine (``hf``, ``vllm`` or ``sglang``), except that the first request it gets waits
    for the engine's first pause (a weight sync with partial rollout) and then ends as cut before
    its first token.

    A sync is then certain to land while a request generates, however fast the others run or
    however busy the machine. Only for runs that pause (``async_training.partial_rollout``):
    without a pause the held request waits until shutdown.
    """

    def __init__(self, engine: RolloutBackend) -> None:
        self.engine = engine
        self.held = False
        self.paused = asyncio.Event()

    async def generate(self, prompt_ids, params, request_id):
        if self.held:
            return await self.engine.generate(prompt_ids, params, request_id)
        self.held = True
        await self.paused.wait()
        return [Generation([], [], "abort") for _ in range(params.n)]

    async def pause(self):
        self.paused.set()
        await self.engine.pause()

    async def resume(self):
        await self.engine.resume()

    async def update_weights(self, buckets):
        await self.engine.update_weights(buckets)

    async def sleep(self, keep_weights=True):
        await self.engine.sleep(keep_weights)

    async def wake_up(self, part=None):
        await self.engine.wake_up(part)

    async def shutdown(self):
        self.paused.set()
        await self.engine.shutdown()


class DiesAfterSyncs(RolloutBackend):
    """A real engine whose process kills itself (SIGKILL, as the OOM killer or a preemption would)
    after ``syncs`` weight loads, in its first incarnation only: the worker Ray restarts runs
    normally. It dies at its first request after them (under ``sync`` that is step 2's
    generation, after step 1's weights; under one_step_off step 1's, its first sync coming
    before step 1), or ``in_sync``: halfway through the next weight load, after its first
    bucket."""

    def __init__(self, engine: RolloutBackend, syncs: int = 1, in_sync: bool = False) -> None:
        self.engine, self.syncs, self.in_sync = engine, syncs, in_sync

    def receiver(self):
        return self.engine.receiver()

    async def join_weight_group(self, group, rank_offset):
        await self.engine.join_weight_group(group, rank_offset)

    async def receive_weights(self, layouts):
        """Over a weight group, ``in_sync`` dies before it receives anything: the trainer's
        broadcast then meets a rank that is gone."""
        self.syncs -= 1
        if self.syncs < 0 and self.in_sync:
            self._die()
        await self.engine.receive_weights(layouts)

    @staticmethod
    def _die() -> None:
        import os
        import signal

        import ray

        if not ray.get_runtime_context().was_current_actor_reconstructed:
            os.kill(os.getpid(), signal.SIGKILL)

    async def generate(self, prompt_ids, params, request_id):
        if self.syncs <= 0 and not self.in_sync:
            self._die()
        return await self.engine.generate(prompt_ids, params, request_id)

    async def update_weights(self, buckets):
        self.syncs -= 1
        await self.engine.update_weights(self._watched(buckets))

    async def _watched(self, buckets):
        async for index, bucket in _enumerate(buckets):
            if self.syncs < 0 and self.in_sync and index == 1:
                self._die()
            yield bucket

    async def pause(self):
        await self.engine.pause()

    async def resume(self):
        await self.engine.resume()

    async def sleep(self, keep_weights=True):
        await self.engine.sleep(keep_weights)

    async def wake_up(self, part=None):
        await self.engine.wake_up(part)

    async def shutdown(self):
        await self.engine.shutdown()


async def _enumerate(items):
    index = 0
    async for item in items:
        yield index, item
        index += 1


class Held(Backend):
    """A registered backend, its engine wrapped: ``held_hf`` reads ``rollout.hf`` and checks as ``hf`` does."""

    section = None  # it reads the wrapped backend's

    def __init__(self, name: str, backend: str, wrapper: type = HeldUntilPaused, joins: bool = False) -> None:
        self.name, self.backend, self.wrapper = name, backend, wrapper
        self.joins_weight_group = joins  # the wrapper passes the group's calls on to the engine

    @property
    def Options(self):  # the wrapped backend's
        return find_backend(self.backend).Options

    def check(self, options):
        find_backend(self.backend).check(options)

    def build(self, options, model_dir):
        return self.wrapper(find_backend(self.backend).build(options, model_dir))


class _HeldPlugin:
    @hookimpl
    def skip_register_backends(self, register):
        register(Held(HELD, "hf"))
        for engine in ENGINES:
            register(Held(f"held_{engine}", engine))
        register(Held(DYING, "hf", DiesAfterSyncs))
        register(Held(DYING_IN_SYNC, "hf", functools.partial(DiesAfterSyncs, syncs=0, in_sync=True)))
        register(Held(DYING_GROUP, "hf", DiesAfterSyncs, joins=True))
        register(Held(DYING_IN_GROUP_SYNC, "hf", functools.partial(DiesAfterSyncs, syncs=0, in_sync=True), joins=True))


def register_held_backend() -> None:
    """Make ``rollout.backend=held_hf`` (and ``held_vllm``, ``held_sglang``, ``dying_hf``) available in this process;
    every worker of the suite's Ray runs it at start (``ray_session``), a test's driver through
    ``held_backend``."""
    from skip_core.plugins import pm

    if not pm.has_plugin(HELD):
        pm.register(_HeldPlugin(), name=HELD)


def unregister_held_backend() -> None:
    from skip_core.plugins import pm

    if pm.has_plugin(HELD):
        pm.unregister(name=HELD)
