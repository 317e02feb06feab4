"""verl 0.9.1's V1 trainer as far as it runs on a CPU: the real ``fit()`` loop of the trainer class
verl picks for ``trainer.v1.trainer_mode``, its real ``ReplayBuffer`` and TransferQueue, and
verl's own ``ppo_trainer.yaml``, with only what needs GPUs scripted:

- ``ScriptedAgentLoop`` stands in for ``AgentLoopManagerTQ``: it writes, per prompt and session,
  what ``AgentLoopWorkerTQ`` writes into TransferQueue (``AgentLoopOutput.as_dict()`` plus the
  prompt's fields, keys ``{uid}_{session}_0``, the same tags), then marks the prompt finished.
  Responses are drawn at random: a second generation never equals the first.
- ``ScriptedActor`` stands in for the actor worker group: its update reports, as metrics, sums of
  what it reads from TransferQueue (advantages, old log-probs), so a replay that fed it other data
  logs other numbers.
- the reward loop runs in the agent loop (verl's streaming reward), the checkpoint manager only
  records its calls, and batch balancing (a GPU worker-group layout) is left out.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from hydra import compose, initialize_config_dir

PARTITION = "train"
# Metrics a replay must reproduce: the data the step trained on, not how long it took.
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "throughput")


def verl_config(dump_dir: Path, mode: str = "sync", steps=(1, 2, 3), total: int = 3, **skip: Any) -> Any:
    """verl's own ``ppo_trainer.yaml``, composed by Hydra as ``main_ppo`` composes it, at a CPU size:
    ``total`` steps, ``skip.rollout_tq`` on for ``steps`` with the ``skip`` settings given."""
    import verl

    settings = {"enable": True, "dump_dir": str(dump_dir), "steps": list(steps), "action": "cache", **skip}
    overrides = [
        f"trainer.v1.trainer_mode={mode}",
        "trainer.experiment_name=exp",
        "trainer.project_name=proj",
        f"trainer.total_training_steps={total}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        "data.train_batch_size=4",
        "data.max_prompt_length=8",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "algorithm.adv_estimator=grpo",
        "algorithm.rollout_correction.bypass_mode=True",
        # separate_async: a standalone rollout pool of its own, weights sent in two mini-batches a step
        "trainer.v1.separate_async.parameter_sync_step=2",
        "actor_rollout_ref.hybrid_engine=False",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]
    # ``++``: skip's keys verl's own schema does not have (``on_prompt_mismatch``) are added.
    overrides += [f"++skip.rollout_tq.{key}={_hydra(value)}" for key, value in settings.items()]
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def _hydra(value: Any) -> str:
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, (list, tuple)) else str(value)


def start_transfer_queue() -> None:
    """A local Ray and ``tq.init`` as verl's ``TaskRunnerV1`` calls it; once per process (each
    test module asks, the first starts them: about 13 s)."""
    import ray

    if ray.is_initialized():
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = verl_config(Path("/nonexistent")).transfer_queue
    config.enable = True
    tq.init(config)


def prompts(seed: int, count: int = 8, batch: int = 4) -> list[dict]:
    """Dataloader batches shaped like verl's RL dataset's (``raw_prompt`` chats, ``index``...)."""
    batches = []
    for start in range(0, count, batch):
        chats = np.empty(batch, dtype=object)
        for i in range(batch):
            chats[i] = [{"role": "user", "content": f"question {seed}-{start + i}"}]
        batches.append(
            {
                "raw_prompt": chats,
                "index": np.arange(start, start + batch),
                "data_source": np.array(["arithmetic"] * batch, dtype=object),
            }
        )
    return batches


class ScriptedAgentLoop:
    """``AgentLoopManagerTQ.generate_sequences``, writing what ``AgentLoopWorkerTQ`` writes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.prompts = 0
        self.asked: list[list[str]] = []  # the prompts of each call, as text
        self.random = random.Random(os.urandom(8))

    def generate_sequences(self, batch: Any) -> None:
        from tensordict import NonTensorData, NonTensorStack
        from verl.experimental.agent_loop import AgentLoopOutput
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        self.asked.append([])
        for i in range(len(batch)):
            prompt = {}
            for key, value in batch.items():
                prompt[key] = value[i].data if isinstance(value, NonTensorStack) else value.data
            assert not any(isinstance(v, NonTensorData) for v in prompt.values())
            self.prompts += 1
            keys, fields, tags = [], [], []
            text = prompt["raw_prompt"][0]["content"]
            self.asked[-1].append(text)
            for session in range(self.n):
                length = self.random.randint(1, 6)
                output = AgentLoopOutput(
                    prompt_ids=[ord(c) % 100 for c in text],
                    response_ids=[self.random.randrange(100) for _ in range(length)],
                    response_mask=[1] * length,
                    response_logprobs=[-self.random.random() for _ in range(length)],
                    reward_score=self.random.random(),
                    num_turns=2,
                    metrics=AgentLoopMetrics(generate_sequences=0.1),
                    extra_fields={"reward_extra_info": {"acc": 1.0}},
                )
                field = output.as_dict()
                field.update(prompt, session_id=session)
                field["loss_mask"] = field["response_mask"]
                field["input_ids"] = torch.cat([field["prompts"], field["responses"]])
                field["position_ids"] = torch.arange(len(field["input_ids"]))
                keys.append(f"{prompt['uid']}_{session}_0")
                fields.append(field)
                step = prompt["global_steps"]
                tags.append(
                    {
                        "status": "success",
                        "prompt_len": len(field["prompts"]),
                        "response_len": length,
                        "seq_len": len(field["input_ids"]),
                        "global_steps": step,
                        "min_global_steps": step,
                        "max_global_steps": step,
                    }
                )
            tq.kv_batch_put(keys=keys, fields=list_of_dict_to_tensordict(fields), tags=tags, partition_id=PARTITION)
            tq.kv_put(key=prompt["uid"], partition_id=PARTITION, tag={"status": "finished"})


class ScriptedActor:
    """The actor worker group's ``update_actor``: metrics computed from the batch it trains on."""

    def __init__(self) -> None:
        self.updates = 0

    def update_actor(self, batch: Any) -> dict:
        self.updates += 1
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["advantages", "old_log_probs"]
        )
        advantages = float(data["advantages"].values().abs().sum())
        old = float(data["old_log_probs"].values().sum())
        return {"metrics": {"pg_loss": [advantages], "old_log_prob_sum": [old], "mfu": [0.0]}}


class Recorder:
    """Any worker-group handle whose calls only need to happen (weight sync, sleep, abort)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.calls.append(name)


def fit(config: Any, data: list[dict], agent_loop: ScriptedAgentLoop | None = None) -> SimpleNamespace:
    """One run of verl's real ``fit()``; the metrics it logged per step (less timings), and its doubles."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    base = get_trainer_cls(config.trainer.v1.trainer_mode)
    logged: list[dict] = []

    class Trainer(base):
        def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
            return batch

        def _get_n_gpus_for_throughput(self) -> int:
            return 1

        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
            logged.append({k: _plain(v) for k, v in metrics.items() if not k.startswith(VOLATILE)})

    trainer = Trainer(config)
    agent_loop = agent_loop or ScriptedAgentLoop(config.actor_rollout_ref.rollout.n)
    actor = ScriptedActor()
    trainer.train_dataloader, trainer.train_dataloader_it = data, None
    trainer.global_steps = 0
    trainer.total_training_steps = config.trainer.total_training_steps
    trainer.steps_per_epoch = len(data)
    trainer.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=["streaming"])
    trainer.checkpoint_manager = trainer.standalone_checkpoint_manager = Recorder()
    trainer.actor_rollout_wg = actor
    trainer._init_dump_executor()
    if config.trainer.v1.trainer_mode == "separate_async":
        from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode

        trainer.current_mode = HybridEngineMode.TRAINER  # no hybrid replicas to lend (``hybrid_engine=False``)
    trainer.fit(agent_loop)
    for uid in list(tq.kv_list(PARTITION).get(PARTITION, {})):
        tq.kv_clear(keys=[uid], partition_id=PARTITION)  # what a new run's TransferQueue starts from
    return SimpleNamespace(metrics=logged, agent_loop=agent_loop, actor=actor)


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
