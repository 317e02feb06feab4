"""verl 0.9.1's defaults, where skip's differ: what a verl launch script that leaves a key unset
gets under verl, against what it gets under ``skip run`` (whose ``run.yaml`` is sized for the
embedded default on a laptop). ``skip run --check`` lists every resolved value that differs.

Keys that name the job rather than the algorithm (paths, names, loggers, lengths of the run,
the device) are not compared. ``plugins/verl/tests/in_verl/test_verl_defaults.py`` composes
verl's ``ppo_trainer.yaml`` and checks this table against it both ways: every value here is
verl's, and every other compared key has skip's default equal to verl's.
"""

from __future__ import annotations

from typing import Any

#: skip path -> verl 0.9.1's default there (its path is the verl key ``verl_keys.alias`` maps to it).
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.filter_overlong_prompts": False,
    "data.seed": None,
    "actor.ppo_mini_batch_size": 256,
    "actor.optim.lr": 1e-06,
    "actor.optim.weight_decay": 0.01,
    "critic.ppo_mini_batch_size": 256,
    "critic.optim.lr": 1e-05,
    "critic.optim.weight_decay": 0.01,
    "rollout.n": 1,
    "rollout.seed": 42,
    "rollout.multi_turn.max_turns": None,
    "algorithm.adv_estimator": "gae",
    "algorithm.filter_groups.metric": "reward",
    "algorithm.rollout_correction.bypass_mode": False,
}

#: Keys compared with no entry above since they name the job, not the algorithm, or verl has no
#: value of its own there (a key its scripts must set, or one it derives from another).
NOT_COMPARED = (
    "model.path", "data.train_files", "data.val_files", "rollout.backend", "rollout.multi_turn.tools_config",
    "rollout.weight_sync", "rollout.update_weights_bucket_megabytes", "reward.custom_reward_function.name",
    "actor.ppo_micro_batch_size", "critic.ppo_micro_batch_size", "actor.fsdp_config.dtype",
    "actor.fsdp_config.model_dtype", "actor.log_prob_use_dynamic_bsz", "actor.log_prob_max_token_len_per_gpu",
    "actor.ref_log_prob_use_dynamic_bsz", "actor.ref_log_prob_max_token_len_per_gpu",
    "critic.forward_max_token_len_per_gpu", "trainer.*", "skip.*",
)  # fmt: skip


def differences(dump: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(path, skip's value, verl's default) for each compared key whose value in ``dump`` (a
    ``RunSettings.dump()``) differs from verl's."""
    found = []
    for path, verl in VERL_DEFAULTS.items():
        node: Any = dump
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != verl:
            found.append((path, node, verl))
    return found


def lines(dump: dict[str, Any]) -> list[str]:
    """What ``--check`` prints: one line per difference, or none."""
    found = differences(dump)
    if not found:
        return []
    shown = ", ".join(f"{path}={skip!r} (verl: {verl!r})" for path, skip, verl in found)
    return [f"differs from verl 0.9.1's defaults (set a key to change it): {shown}"]
