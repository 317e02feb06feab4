"""Regenerate the verl rollout-skip dumps under this directory with real verl (run by hand).

The files are written by verl itself: ``verl.utils.skip.SkipManager`` is initialised from a
verl-style run config, a ``generate_sequences(self, prompts)`` decorated with
``@SkipManager.annotate(role="rollout")`` is called on each listed step, and verl's
``RolloutSkip.prepare_data`` writes ``gen_batch.dp`` (``DataProto.save_to_disk``: a pickle
whose ``DataProto.__getstate__`` embeds the consolidated TensorDict as ``torch.save`` bytes)
and ``meta.json`` (``{"global_steps": step}``) under
``{dump_dir}/{experiment_name}_{project_name}/GBS{gbs}_N{n}_in{prompt}_out{response}/{step}/``.

Two dumps are made:

* ``dump_default/``: verl's default serialization (TensorDict through ``torch.save``).
* ``dump_numpy/``: the same with ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy`` (verl's
  alternative ``__getstate__``: tensors as raw uint8 numpy arrays).

Setup used to make the committed files (Python 3.11; CPU torch; verl pins tensordict
>=0.8,<=0.10,!=0.9.0)::

    python -m venv /work/venv-verl
    /work/venv-verl/bin/pip install -c constraints.txt torch==2.13.0
    /work/venv-verl/bin/pip install -c constraints.txt verl==0.9.1 --no-deps
    /work/venv-verl/bin/pip install -c constraints.txt tensordict==0.10.0 ray omegaconf transformers
    /work/venv-verl/bin/python tests/data/verl/make_fixture.py

The batch content is a pure function of the step (``rollout_output``), free of random
numbers, so the tests rebuild the expected values without verl. ``fixture_info.json``
records the versions that wrote the files.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
EXPERIMENT = "qwen-grpo"
PROJECT = "skip-fixture"
GBS = 2  # data.train_batch_size: prompts per step
N = 2  # actor_rollout_ref.rollout.n: responses per prompt
PROMPT_LEN = 8
RESPONSE_LEN = 8
STEPS = (1, 2)
DUMPS = {"dump_default": None, "dump_numpy": "numpy"}  # directory: VERL_DATAPROTO_SERIALIZATION_METHOD
RUN = f"{EXPERIMENT}_{PROJECT}"
SHAPE = f"GBS{GBS}_N{N}_in{PROMPT_LEN}_out{RESPONSE_LEN}"


def step_dir(dump_dir: Path, step: int, run: str = RUN) -> Path:
    """Where verl's rollout skip writes a step's ``gen_batch.dp`` and ``meta.json``."""
    return dump_dir / run / SHAPE / str(step)


def run_config(dump_dir: str) -> dict:
    """The parts of a verl run config that RolloutSkip and skip's Namespace read."""
    return {
        "trainer": {"experiment_name": EXPERIMENT, "project_name": PROJECT, "v1": {"trainer_mode": "sync"}},
        "data": {"train_batch_size": GBS, "max_prompt_length": PROMPT_LEN, "max_response_length": RESPONSE_LEN},
        "actor_rollout_ref": {"rollout": {"n": N}},
        "skip": {"rollout": {"enable": True, "dump_dir": dump_dir, "steps": list(STEPS), "action": "cache"}},
    }


def _objects(items: list) -> np.ndarray:
    """A 1-d object array, element by element (nested lists must not become extra dimensions)."""
    array = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        array[i] = item
    return array


def rollout_output(step: int) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray], dict[str, Any]]:
    """What an agent-loop ``generate_sequences`` returns on ``step``: tensors, non-tensors, meta_info.

    Keys follow verl 0.9.1's ``AgentLoopWorker._postprocess`` output; ``teacher_logprobs`` is
    bfloat16 and ``response_mask`` bool to cover more dtypes.
    """
    size = GBS * N
    rows = torch.arange(size).unsqueeze(1)
    prompt_lens = torch.tensor([5, 5, 8, 8])[:size]
    response_lens = torch.tensor([3, 8, 1, 6])[:size]
    cols_p = torch.arange(PROMPT_LEN).unsqueeze(0)
    cols_r = torch.arange(RESPONSE_LEN).unsqueeze(0)
    prompt_mask = cols_p >= PROMPT_LEN - prompt_lens.unsqueeze(1)  # left padded
    response_mask = cols_r < response_lens.unsqueeze(1)  # right padded
    prompts = torch.where(prompt_mask, 100 * step + 10 * (rows // N) + cols_p, 0)
    responses = torch.where(response_mask, 1000 * step + 10 * rows + cols_r, 0)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    log_probs = torch.where(response_mask, -0.125 * (cols_r + 1) - 0.5 * rows - step, 0.0).float()
    rm_scores = torch.zeros(size, RESPONSE_LEN, dtype=torch.float32)
    rm_scores[torch.arange(size), response_lens - 1] = torch.tensor([1.0, 0.0, 1.0, 0.5])[:size]
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "rollout_log_probs": log_probs,
        "teacher_logprobs": log_probs.to(torch.bfloat16),
        "rm_scores": rm_scores,
    }
    groups = [i // N for i in range(size)]
    questions = [f"Step {step}, question {g}: what is {g} + {step}? ¿Sí?" for g in groups]
    non_tensors = {
        "uid": _objects([f"{step:04d}-uid-{g}" for g in groups]),
        "data_source": _objects(["openai/gsm8k"] * size),
        "agent_name": _objects(["single_turn_agent"] * size),
        "raw_prompt": _objects([[{"role": "user", "content": q}] for q in questions]),
        "reward_model": _objects([{"style": "rule", "ground_truth": str(g + step)} for g in groups]),
        "extra_info": _objects([{"index": g, "split": "train", "answer": None} for g in groups]),
        "index": np.array(groups, dtype=np.int64),
        "__num_turns__": np.array([2] * size, dtype=np.int32),
        "acc": np.array([1.0, 0.0, 1.0, 0.5][:size]),
        "turn_scores": _objects([[] for _ in range(size)]),
        "tool_rewards": _objects([[0.25 * i] for i in range(size)]),
        "min_global_steps": _objects([step] * size),
        "max_global_steps": _objects([step] * size),
        "extras": _objects([None] * size),
    }
    meta_info = {
        "timing": {
            "agent_loop/generate_sequences/mean": np.float64(0.5 * step),
            "agent_loop/num_preempted/max": np.int64(0),
            "agent_loop/slowest/prompt_length": 8,
        },
        "reward_extra_keys": ["acc"],
    }
    return tensors, non_tensors, meta_info


def main() -> None:
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.utils.skip import SkipManager

    class Rollout:
        @SkipManager.annotate(role="rollout")
        def generate_sequences(self, prompts):
            step = prompts.meta_info["global_steps"]
            tensors, non_tensors, meta_info = rollout_output(step)
            return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)

    for name, method in DUMPS.items():
        root = HERE / name
        shutil.rmtree(root, ignore_errors=True)
        if method is None:
            os.environ.pop("VERL_DATAPROTO_SERIALIZATION_METHOD", None)
        else:
            os.environ["VERL_DATAPROTO_SERIALIZATION_METHOD"] = method
        SkipManager.init(OmegaConf.create(run_config(str(root))))
        for step in STEPS:
            SkipManager.set_step(step)
            prompts = DataProto.from_dict(
                tensors={"input_ids": torch.zeros(GBS * N, PROMPT_LEN, dtype=torch.long)},
                meta_info={"global_steps": step},
            )
            Rollout().generate_sequences(prompts)
        for step in STEPS:  # read back with verl and compare
            path = step_dir(root, step)
            loaded = DataProto.load_from_disk(path / "gen_batch.dp")
            tensors, non_tensors, _ = rollout_output(step)
            assert all(torch.equal(loaded.batch[k], v) for k, v in tensors.items()), step
            assert sorted(loaded.non_tensor_batch) == sorted(non_tensors), step
            assert json.loads((path / "meta.json").read_text()) == {"global_steps": step}
    os.environ.pop("VERL_DATAPROTO_SERIALIZATION_METHOD", None)

    import tensordict
    import verl

    info = {
        "written_by": "tests/data/verl/make_fixture.py through verl.utils.skip.SkipManager",
        "python": platform.python_version(),
        "verl": verl.__version__,
        "tensordict": tensordict.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "serialization": {name: method or "torch.save (default)" for name, method in DUMPS.items()},
    }
    (HERE / "fixture_info.json").write_text(json.dumps(info, indent=1) + "\n")
    total = sum(p.stat().st_size for name in DUMPS for p in (HERE / name).rglob("*") if p.is_file())
    print(f"wrote {', '.join(DUMPS)} under {HERE} ({total} bytes) with verl {verl.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
