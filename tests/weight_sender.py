"""A trainer's rank 0 for the backends' weight-group tests, in a process of its own (torch takes a
group's name once per process, and the engine under test is rank 1 on): it hosts the group, says
where it meets, then broadcasts the buckets of a safetensors file, each cast to the engines'
dtype, through the same ``skip_core.weight_group`` calls the trainer's policy makes."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

from skip_core.weight_group import Layout, TensorSpec, WeightGroup

TIMEOUT_S = 120.0


def layouts(state: dict[str, Any], buckets: list[list[str]], dtype: str) -> list[Layout]:
    return [tuple(TensorSpec(name, dtype, tuple(state[name].shape)) for name in names) for names in buckets]


class WeightSender:
    """``group``: where the engines join, as ranks 1 to ``receivers``."""

    def __init__(self, receivers: int, name: str = "skip-test-weights") -> None:
        self._conn, child = multiprocessing.get_context("spawn").Pipe()
        self._process = multiprocessing.get_context("spawn").Process(target=_serve, args=(child, receivers + 1))
        self._process.start()
        port = self._expect("port")
        self.group = WeightGroup("127.0.0.1", port, receivers + 1, "gloo", name, timeout_s=TIMEOUT_S)

    def join(self) -> None:
        """Starts rank 0's join; the engines' joins complete it."""
        self._conn.send(("join", self.group))

    def send(self, path: Path, buckets: list[list[str]], dtype: str) -> None:
        self._conn.send(("send", str(path), buckets, dtype))

    def done(self) -> Any:
        return self._expect("done")

    def _expect(self, what: str) -> Any:
        if not self._conn.poll(TIMEOUT_S):
            raise TimeoutError(f"the weight sender did not say {what} in {TIMEOUT_S} s")
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"the weight sender failed: {value}")
        return value

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._conn.send(("stop",))
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()


def _serve(conn: Any, world_size: int) -> None:
    import torch
    from safetensors.torch import load_file
    from skip_core import weight_group

    store = weight_group.host("127.0.0.1", world_size, TIMEOUT_S)
    conn.send(("port", store.port))
    pg = None
    while True:
        message = conn.recv()
        try:
            if message[0] == "stop":
                break
            if message[0] == "join":
                pg = weight_group.join(message[1], 0, store)
                conn.send(("done", None))
            elif message[0] == "send":
                _, path, buckets, dtype = message
                state = load_file(path)
                for names in buckets:
                    flat = weight_group.flatten([state[n] for n in names], getattr(torch, dtype), "cpu")
                    weight_group.send(pg, flat).wait()
                conn.send(("done", None))
        except Exception as exc:  # said to the test, which fails naming it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    weight_group.leave(pg)
