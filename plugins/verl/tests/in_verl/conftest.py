"""What the bridge tests share: a verl run config, verl's own decorated rollout managers with
scripted workers in place of verl's Ray agent-loop workers, and files that would run code if
unpickled. Runs in a venv with verl 0.9.1 and skip installed beside it, nothing imported by hand."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import skip_core
import torch
from omegaconf import OmegaConf
from verl.protocol import DataProto

SHAPE = "GBS2_N2_in4_out4"


def run_config(dump_dir: Path, role: str = "rollout", experiment: str = "exp", **section) -> OmegaConf:
    """verl's trainer config, as far as its SkipManager reads it, with ``skip.<role>`` enabled."""
    settings = {"enable": True, "dump_dir": str(dump_dir), "steps": [1, 2, 3], "action": "cache", **section}
    disabled = {"enable": False, "dump_dir": "~/.verl/rollout_dump", "steps": [], "action": "cache"}
    skip = {name: dict(disabled) for name in ("rollout", "rollout_tq", "async_rollout")}
    return OmegaConf.create(
        {
            "trainer": {"experiment_name": experiment, "project_name": "proj", "v1": {"trainer_mode": "sync"}},
            "data": {"train_batch_size": 2, "max_prompt_length": 4, "max_response_length": 4},
            "actor_rollout_ref": {"rollout": {"n": 2}},
            "skip": {"_target_": "verl.utils.skip.SkipManagerConfig", **skip, role: settings},
        }
    )


def prompts(seed: int = 0, uid: str | None = None, validate: bool = False, n: int = 2) -> DataProto:
    """A prompt batch as verl's trainer builds one; ``uid`` is random in verl, so it varies here."""
    ids = torch.arange(n * 4).view(n, 4) + seed
    uids = [uid or f"{os.urandom(4).hex()}-{i}" for i in range(n)]
    chats = np.empty(n, dtype=object)  # one chat (a list of messages) per sample, as verl's dataset gives
    for i in range(n):
        chats[i] = [{"role": "user", "content": f"question {seed}-{i}"}]
    return DataProto.from_dict(
        tensors={"input_ids": ids},
        non_tensors={"uid": np.array(uids, dtype=object), "raw_prompt": chats},
        meta_info={"validate": validate, "global_steps": 1},
    )


class ScriptedWorker:
    """Stands in for verl's ``AgentLoopWorker`` actor: ``generate_sequences.remote(batch)`` gives
    a Ray-like reference (awaitable, with ``.future()``) to a deterministic output."""

    def __init__(self) -> None:
        self.batches: list[DataProto] = []
        self.generate_sequences = self

    def remote(self, batch: DataProto) -> _Ref:
        self.batches.append(batch)
        ids = batch.batch["input_ids"]
        # what verl's AgentLoopManager reads from each worker's output for its timing metrics
        timing = {"generate_sequences": 0.5, "tool_calls": 0.5, "compute_score": 0.5, "num_preempted": 0}
        out = DataProto.from_dict(
            tensors={"prompts": ids, "responses": ids * 10 + 1, "response_mask": torch.ones_like(ids)},
            non_tensors={"__num_turns__": np.full(len(batch), 2, dtype=np.int32)},
            meta_info={"metrics": [timing] * len(batch)},
        )
        return _Ref(out)


class _Ref:
    def __init__(self, value: DataProto) -> None:
        self.value = value

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        return self.value

    def future(self) -> Future:
        done = Future()
        done.set_result(self.value)
        return done


@pytest.fixture
def worker() -> ScriptedWorker:
    return ScriptedWorker()


@pytest.fixture
def rollout_manager(worker):
    """verl's ``AgentLoopManager``: ``generate_sequences`` is verl's, decorated by verl with
    ``@auto_await`` and ``@SkipManager.annotate(role="rollout")``."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager

    manager = object.__new__(AgentLoopManager)
    manager.agent_loop_workers = [worker]
    return manager


@pytest.fixture
def async_manager(worker):
    """verl's fully-async ``FullyAsyncAgentLoopManager``: ``generate_sequences_single`` carries
    ``@SkipManager.annotate(role="async_rollout")``."""
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncAgentLoopManager

    manager = object.__new__(FullyAsyncAgentLoopManager)
    manager.agent_loop_workers = [worker]
    return manager


@pytest.fixture(autouse=True)
def _fresh_manager():
    skip_core.SkipManager.reset()
    yield
    skip_core.SkipManager.reset()


class Planted:
    """Unpickling this creates ``marker``: what a malicious or foreign dump could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant_verl_dump(step_dir: Path, marker: Path) -> Path:
    """A verl-layout step directory whose ``gen_batch.dp`` runs code when verl loads it."""
    step_dir.mkdir(parents=True)
    (step_dir / "gen_batch.dp").write_bytes(pickle.dumps(Planted(marker)))
    (step_dir / "meta.json").write_text(json.dumps({"global_steps": int(step_dir.name)}))
    return step_dir


def same(a: DataProto, b: DataProto) -> bool:
    """Equal tensors (dtypes too), non-tensors and meta_info."""
    from skip_core.batch import Batch

    def as_batch(proto: DataProto) -> Batch:
        return Batch(dict(proto.batch.items()), proto.non_tensor_batch, proto.meta_info)

    return as_batch(a).equals(as_batch(b))
