"""verl's key paths under ``skip run``: resolved to skip's before the one validation pass.

A verl launch script passes ``actor_rollout_ref.rollout.n=5``; skip's trainer calls that key
``rollout.n``. ``resolve`` rewrites a run config (plain data, after Hydra) so that every key is
one of skip's, and sorts each verl key into one of four kinds:

- an alias (``ALIASES``): the same setting at skip's path, moved there; a verl path a user wrote
  wins over skip's default at the same place;
- a key that only tunes verl's GPU parallelism, memory or speed, or verl's own logging and files
  (``UNUSED``): dropped, and listed in one warning that says why each changes nothing here;
- a key that changes the algorithm in a way skip does not implement (``UNIMPLEMENTED``): accepted
  at verl's default, which asks for what skip does anyway, and refused in one line otherwise;
- a few whose meaning depends on their value or on another key (``_MAPPINGS``), mapped to skip's.

Every other key goes on to the sections' models, which refuse a key they do not declare: no key
is accepted and ignored.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from skip_core.config import ConfigError

#: verl's path (a prefix) -> skip's, applied until none matches; the longest prefix first.
ALIASES: dict[str, str] = {
    "actor_rollout_ref.actor": "actor",
    "actor_rollout_ref.rollout": "rollout",
    "actor_rollout_ref.model": "model",
    "actor_rollout_ref.ref": "ref",  # the frozen reference: skip keeps it beside the actor
    "rollout.name": "rollout.backend",
    "rollout.multi_turn.tool_config_path": "rollout.multi_turn.tools_config",
    "rollout.multi_turn.max_assistant_turns": "rollout.multi_turn.max_turns",
    "reward_model.overlong_buffer": "reward.overlong_buffer",  # verl 0.9's DAPO recipe
    "reward.reward_kwargs.overlong_buffer_cfg": "reward.overlong_buffer",  # verl 0.10's
    "custom_reward_function": "reward.custom_reward_function",  # verl 0.9's place; 0.10's is skip's
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "actor.optim.clip_grad": "actor.grad_clip",
    # skip has one actor worker: a GPU's micro-batch is its micro-batch (memory only, either way)
    "actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
    "critic.ppo_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size",
    "critic.optim.clip_grad": "critic.grad_clip",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep": "trainer.max_ckpt_to_keep",
}

_GPU = "they tune verl's GPU parallelism, memory or speed"
_LOGS = "verl's own logging and files: skip logs with trainer.logger, and skip.rollout keeps every rollout"
#: Keys (patterns over skip's paths) that change nothing computed here, and why.
UNUSED: dict[str, str] = {
    **dict.fromkeys(
        [
            "*_per_gpu",
            "*.use_dynamic_bsz",
            "*.log_prob_use_dynamic_bsz",
            "*max_token_len*",
            "*.fsdp_config.*",
            "*.ulysses_sequence_parallel_size",
            "*.use_remove_padding",
            "*.enable_gradient_checkpointing",
            "*.enable_activation_offload",
            "*.use_fused_kernels",
            "*.use_liger",
            "*.use_shm",
            "*.strategy",
            "*.megatron.*",
            "*.fsdp.*",
            "*.nnodes",
            "*.n_gpus_per_node",
            "model_engine",
            "actor_rollout_ref.hybrid_engine",
            "ray_kwargs.*",
            "*.use_torch_compile",
            "*.entropy_checkpointing",
            "*.entropy_from_logits_with_chunking",
            "*.tensor_model_parallel_size",
            "*.data_parallel_size",
            "*.expert_parallel_size",
            "*.pipeline_model_parallel_size",
            "*.trust_remote_code",
            "trainer.ray_wait_register_center_timeout",
            "rollout.gpu_memory_utilization",
            "rollout.enable_chunked_prefill",
            "rollout.enable_prefix_caching",
            "rollout.free_cache_engine",
            "rollout.enforce_eager",
            "rollout.load_format",
            "rollout.layered_summon",
            "rollout.max_num_batched_tokens",
            "rollout.max_num_seqs",
            "rollout.cudagraph_capture_sizes",
            "rollout.disable_log_stats",
            "rollout.agent.num_workers",
            "rollout.checkpoint_engine.*",
            "ref.*",
            "data.dataloader_num_workers",
            "data.filter_overlong_prompts_workers",
            "data.val_batch_size",
            "reward.num_workers",
            "reward_model.num_workers",
            "data.return_raw_input_ids",
            "data.return_full_prompt",
        ],
        _GPU,
    ),
    **dict.fromkeys(
        [
            "trainer.log_val_generations",
            "trainer.rollout_data_dir",
            "trainer.validation_data_dir",
            "reward.overlong_buffer.log",
            "actor.checkpoint.*",
            "critic.checkpoint.*",
            "global_profiler.*",
        ],
        _LOGS,
    ),
    "trainer.balance_batch": "skip's actor is one data-parallel rank: there is nothing to balance",
    "rollout.val_kwargs.do_sample": "verl's agent loop validates with val_kwargs.temperature, as skip does",
    "rollout.over_sample_rate": "verl 0.9 reads it nowhere",
    "*.optim.total_training_steps": "verl fills it with the run's length, as skip does",
    "rollout.multi_stage_wake_up": "verl 0.9 reads it nowhere",
    "rollout.calculate_log_probs": "skip's engines always return the sampled tokens' log-probs",
    "data.return_raw_chat": "skip's agent loop always renders the raw chat itself",
    "rollout.mode": "skip's agent loop is always verl's async (server) mode",
    "algorithm.kl_ctrl.horizon": "verl reads it only with algorithm.kl_ctrl.type=adaptive, which skip refuses",
    "algorithm.kl_ctrl.target_kl": "verl reads it only with algorithm.kl_ctrl.type=adaptive, which skip refuses",
}

#: Keys skip accepts only at verl's default: skip path -> (that default, what skip does instead).
#: A tuple of defaults lists the spellings of one value.
UNIMPLEMENTED: dict[str, tuple[Any, str]] = {
    "actor.fsdp_config.model_dtype": (("fp32", "float32"), "skip trains in float32"),
    "model.lora_adapter_path": (None, "skip's LoRA starts from new adapters (model.lora_rank)"),
    "critic.model.lora_rank": (0, "skip's critic trains every weight (model.lora_rank is the actor's)"),
    "model.external_lib": (None, "skip imports no module a config names"),
    "model.override_config": ({}, "skip loads model.path's config as it is"),
    "model.custom_chat_template": (None, "skip renders prompts with model.path's own chat template"),
    "model.tokenizer_path": (None, "skip loads the tokenizer of model.path"),
    "model.hf_config_path": (None, "skip loads model.path's config as it is"),
    "data.tokenizer": (None, "skip loads the tokenizer of model.path"),
    "data.reward_fn_key": ("data_source", "skip picks a row's scorer by its data_source"),
    "data.custom_cls.path": (None, "skip reads data.train_files with its own dataset"),
    "actor.policy_loss.loss_mode": ("vanilla", "skip's policy loss is verl's vanilla PPO clip"),
    "actor.optim.zero_indexed_step": (True, "skip's schedule counts updates from 0"),
    "actor.optim.optimizer": ("AdamW", "skip's optimizer is torch's AdamW"),
    "critic.optim.optimizer": ("AdamW", "skip's optimizer is torch's AdamW"),
    "actor.optim.optimizer_impl": ("torch.optim", "skip's optimizer is torch's AdamW"),
    "critic.optim.optimizer_impl": ("torch.optim", "skip's optimizer is torch's AdamW"),
    "critic.optim.zero_indexed_step": (True, "skip's schedule counts updates from 0"),
    "algorithm.kl_ctrl.type": ("fixed", "skip's in-reward KL coefficient is fixed (algorithm.kl_coef)"),
    "algorithm.use_pf_ppo": (False, "skip does not reweight samples by reward (PF-PPO)"),
    "reward_model.enable": (False, "skip scores with a rule-based function (reward.function), no reward model"),
    "reward.reward_model.enable": (False, "skip scores with a rule-based function (reward.function), no reward model"),
    "data.train_max_samples": (-1, "skip trains on every row of data.train_files"),
    "data.val_max_samples": (-1, "skip validates on every row of data.val_files"),
    "trainer.val_only": (False, "skip run trains; validation runs every trainer.test_freq steps"),
    "trainer.default_hdfs_dir": (None, "skip writes checkpoints to trainer.default_local_dir only"),
    "trainer.use_v1": (True, "skip's trainer is its own; trainer.schedule picks its schedule"),
    "trainer.v1.trainer_mode": ("sync", "skip's schedule is trainer.schedule (sync, one_step_off, fully_async)"),
}


@dataclass
class Resolved:
    """A run config in skip's paths, with where each moved key came from and what was dropped."""

    config: dict[str, Any]
    origins: dict[str, str] = field(default_factory=dict)  # skip path -> the verl path written
    unused: dict[str, str] = field(default_factory=dict)  # key as written -> why it changes nothing

    def warning(self) -> str | None:
        """One line listing the dropped keys, grouped by why, or None."""
        if not self.unused:
            return None
        groups: dict[str, list[str]] = {}
        for key, why in self.unused.items():
            groups.setdefault(why, []).append(key)
        parts = [f"{', '.join(sorted(keys))} ({why})" for why, keys in groups.items()]
        return "verl keys that change nothing here, accepted and unused: " + "; ".join(parts)

    def written(self, key: str) -> str:
        """``key`` as the user wrote it: its verl path, when it was one."""
        for prefix in sorted(self.origins, key=len, reverse=True):
            if key == prefix or key.startswith(f"{prefix}."):
                return self.origins[prefix] + key[len(prefix) :]
        return key


def resolve(config: Any) -> Resolved:
    """Move verl's paths to skip's, then (interpolations resolved against the moved values, so a
    shipped ``${actor.ppo_mini_batch_size}`` follows a script's ``actor_rollout_ref.actor.*``)
    drop the keys that change nothing here and refuse unimplemented ones."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(config, resolve=False) if OmegaConf.is_config(config) else config
    resolved = Resolved({})
    moved: list[tuple[str, str, Any]] = []
    for path, value in _leaves(raw):
        target = alias(path)
        if target == path:
            _put(resolved.config, path, value)
        else:
            moved.append((path, target, value))
    for path, target, value in moved:  # a verl path a user wrote wins over skip's default
        earlier = resolved.origins.get(target)
        if earlier is not None and _get(resolved.config, target) != value:
            raise ConfigError(f"{path}: sets {target}, which {earlier} sets to another value")
        _put(resolved.config, target, value)
        resolved.origins[target] = path
    resolved.config = _sorted(resolved, _resolved(resolved.config))
    for mapping in _MAPPINGS:
        mapping(resolved)
    return resolved


def _resolved(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its interpolations resolved; one naming a missing key is an error line."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.create(config), resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise ConfigError(f"{key}: {str(exc).splitlines()[0]}") from None


def _sorted(resolved: Resolved, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` without the keys that change nothing here (listed in ``resolved.unused``);
    an unimplemented key away from verl's default is an error naming it as written."""
    kept: dict[str, Any] = {}
    for path, value in _leaves(config):
        written = resolved.written(path)
        refused = _unimplemented(path)
        if refused is not None:
            default, instead = UNIMPLEMENTED[refused]
            accepted = default if isinstance(default, tuple) else (default,)
            if path != refused or value not in accepted:  # a key under it sets what the default leaves empty
                key = written[: len(written) - len(path) + len(refused)]
                raise ConfigError(f"{key}: not implemented: {instead} (verl's default is {accepted[0]!r})")
        elif _unused(path) is not None:
            resolved.unused[written] = _unused(path)
        else:
            _put(kept, path, value)
    return kept


def alias(path: str) -> str:
    """skip's path for ``path`` (``actor_rollout_ref.rollout.name`` -> ``rollout.backend``)."""
    for _ in range(len(ALIASES) + 1):
        for prefix in sorted(ALIASES, key=len, reverse=True):
            if (path == prefix or path.startswith(f"{prefix}.")) and ALIASES[prefix] != prefix:
                path = ALIASES[prefix] + path[len(prefix) :]
                break
        else:
            return path
    return path


def _unimplemented(path: str) -> str | None:
    """The ``UNIMPLEMENTED`` key ``path`` is, or lies under."""
    for key in UNIMPLEMENTED:
        if path == key or path.startswith(f"{key}."):
            return key
    return None


def _unused(path: str) -> str | None:
    for pattern, why in UNUSED.items():
        if fnmatch.fnmatchcase(path, pattern):
            return why
    return None


def _leaves(node: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, value)`` for every value that is not a non-empty mapping."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{path}.")
        else:
            yield path, value


def _put(config: dict[str, Any], path: str, value: Any) -> None:
    *parents, name = path.split(".")
    node = config
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[name] = value


def _get(config: Mapping[str, Any], path: str, default: Any = None) -> Any:
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _pop(config: dict[str, Any], path: str) -> Any:
    *parents, name = path.split(".")
    node = _get(config, ".".join(parents)) if parents else config
    return node.pop(name, None) if isinstance(node, dict) else None


# -- keys whose meaning depends on a value -------------------------------------------------


def _multi_turn(resolved: Resolved) -> None:
    """verl's ``multi_turn.enable``: off is one assistant turn and no tools; on is skip's loop."""
    config = resolved.config
    enable = _pop(config, "rollout.multi_turn.enable")
    if enable is False:
        _put(config, "rollout.multi_turn.tools_config", None)
        _put(config, "rollout.multi_turn.max_turns", 1)


def _clip_ratio(resolved: Resolved) -> None:
    """verl's symmetric ``actor.clip_ratio`` stands for whichever bound is not given its own."""
    config = resolved.config
    ratio = _pop(config, "actor.clip_ratio")
    if ratio is None:
        return
    written = resolved.origins.get("actor.clip_ratio", "actor.clip_ratio")
    for bound in ("actor.clip_ratio_low", "actor.clip_ratio_high"):
        if bound not in resolved.origins:
            _put(config, bound, ratio)
            resolved.origins[bound] = written


_MANAGERS = ("naive", "dapo")


def _reward_manager(resolved: Resolved) -> None:
    """verl's reward managers skip has: ``naive`` (the function's score) and ``dapo`` (plus the
    overlong buffer when ``overlong_buffer.enable``), both what skip's reward computes."""
    config = resolved.config
    for key in ("reward_model.reward_manager", "reward.reward_manager.name"):
        name = _pop(config, key)
        if name is None:
            continue
        if name not in _MANAGERS:
            raise ConfigError(
                f"{key}: {name!r} is not implemented: skip's reward is the function's score, with DAPO's "
                f"overlong buffer when reward.overlong_buffer.enable (allowed: {', '.join(_MANAGERS)})"
            )
        if name == "naive" and _get(config, "reward.overlong_buffer.enable"):
            raise ConfigError(
                f"{key}: naive has no overlong buffer, but reward.overlong_buffer.enable is true; use dapo"
            )
    length = _pop(config, "reward.reward_kwargs.max_resp_len")
    if length is not None and length != _get(config, "data.max_response_length"):
        raise ConfigError(
            f"reward.reward_kwargs.max_resp_len: {length!r} is not implemented: skip's overlong buffer ends at "
            f"data.max_response_length ({_get(config, 'data.max_response_length')!r})"
        )
    for empty in ("reward_model", "reward.reward_manager", "reward.reward_kwargs"):
        if _get(config, empty) == {}:
            _pop(config, empty)


def _critic_model(resolved: Resolved) -> None:
    """verl's ``critic.model.path``: skip's critic starts from the policy's weights (model.path)."""
    path = _pop(resolved.config, "critic.model.path")
    policy = _get(resolved.config, "model.path")
    if path is not None and path != policy:
        raise ConfigError(
            f"critic.model.path: {path!r} is not implemented: skip's critic starts from model.path ({policy!r})"
        )
    if _get(resolved.config, "critic.model") == {}:
        _pop(resolved.config, "critic.model")


def _fully_async_batch(resolved: Resolved) -> None:
    """``data.train_batch_size=0``, as verl's fully-async launches write it: prompts stream one by
    one, and an update takes ``actor.ppo_mini_batch_size x async_training.require_batches``."""
    config = resolved.config
    if _get(config, "data.train_batch_size") != 0:
        return
    schedule = _get(config, "trainer.schedule", "sync")
    if schedule != "fully_async":
        raise ConfigError(
            f"data.train_batch_size: 0 is fully-async's (prompts stream one by one), not {schedule}'s; "
            "set trainer.schedule=fully_async or a batch size"
        )
    mini = _get(config, "actor.ppo_mini_batch_size")
    batches = _get(config, "async_training.require_batches") or 1
    if isinstance(mini, int) and isinstance(batches, int):
        _put(config, "data.train_batch_size", mini * batches)
        _put(config, "async_training.require_batches", batches)


def _total_rollout_steps(resolved: Resolved) -> None:
    """fully-async's ``rollout.total_rollout_steps``: the prompts the rollouter feeds in all, so
    that many over the prompts of one update is the run's length in updates (it sets
    ``trainer.total_training_steps``, as it sets the length of verl's fully-async run)."""
    config = resolved.config
    total = _pop(config, "rollout.total_rollout_steps")
    if total is None:
        return
    if _get(config, "trainer.schedule", "sync") != "fully_async":
        raise ConfigError(
            "rollout.total_rollout_steps: fully-async's length in prompts; set trainer.schedule=fully_async"
        )
    batch = _get(config, "data.train_batch_size")
    if not isinstance(total, int) or total < 1 or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"rollout.total_rollout_steps: expected a number of prompts >= 1, got {total!r}")
    steps, before = max(1, total // batch), _get(config, "trainer.total_training_steps")
    if before is not None and before != steps:  # the shipped run.yaml's 20, or the user's: said either way
        warnings.warn(
            f"rollout.total_rollout_steps={total}: sets trainer.total_training_steps to {steps} "
            f"({total} prompts / {batch} per update), not {before}",
            stacklevel=4,
        )
    _put(config, "trainer.total_training_steps", steps)


_MAPPINGS: list[Callable[[Resolved], None]] = [
    _multi_turn,
    _clip_ratio,
    _reward_manager,
    _critic_model,
    _fully_async_batch,
    _total_rollout_steps,
]
