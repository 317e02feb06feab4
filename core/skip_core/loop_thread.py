"""An asyncio event loop of its own, running in a daemon thread.

The agent loop, the trainer's generations and the vLLM and SGLang engines each need one: an
engine's output handler serves the loop it started on for good, a synchronous trainer must
wait on coroutines, and callers on other loops (streamed samples, one ``asyncio.run`` per
batch) must await them. A coroutine handed over runs in a copy of the caller's context, so its
spans nest under the caller's span and see the caller's step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.stopped = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        try:
            self.loop.run_forever()
        finally:  # stopped: its selector and pipes go now, not with a ResourceWarning at exit
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start ``coro`` on this loop and return at once, from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this loop and wait for its result (never call from this loop itself)."""
        return self.submit(coro).result()

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on this loop from another one; cancelling the caller cancels it."""
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self) -> None:
        """Stop the loop once the callbacks already scheduled have run; what is pending stays pending."""
        self.stopped = True
        self.loop.call_soon_threadsafe(self.loop.stop)
