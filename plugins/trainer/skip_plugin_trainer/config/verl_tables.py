"""The tables of verl's keys under ``skip run`` (``verl_keys.py`` applies them): the aliases of
skip's settings, the keys that change nothing here and why, and those skip accepts only at
verl's default, with the reason. Each entry is a fact about verl 0.9.1's config; the corpus
test (``tests/verl_corpus``) holds them against verl's launch scripts.
"""

from __future__ import annotations

from typing import Any

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
    "reward_model.reward_kwargs": "reward.reward_kwargs",  # the path verl migrates to the one above
    "custom_reward_function": "reward.custom_reward_function",  # verl 0.9's place; 0.10's is skip's
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "actor.optim.clip_grad": "actor.grad_clip",
    # skip has one actor worker: a GPU's micro-batch is its micro-batch (memory only, either way)
    "actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
    "critic.ppo_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size",
    "critic.optim.clip_grad": "critic.grad_clip",
    # the log-prob passes' budgets: skip's policy holds the reference, so both are actor keys
    "rollout.log_prob_use_dynamic_bsz": "actor.log_prob_use_dynamic_bsz",
    "rollout.log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    "ref.log_prob_use_dynamic_bsz": "actor.ref_log_prob_use_dynamic_bsz",
    "ref.log_prob_max_token_len_per_gpu": "actor.ref_log_prob_max_token_len_per_gpu",
    "ref.fsdp_config.param_offload": "actor.ref_param_offload",
    # verl's fsdp_config copies of the actor's keys (its own yaml interpolates them)
    "actor.fsdp_config.entropy_from_logits_with_chunking": "actor.entropy_from_logits_with_chunking",
    "actor.fsdp_config.entropy_from_logits_chunk_size": "actor.entropy_from_logits_chunk_size",
    "actor.fsdp_config.entropy_checkpointing": "actor.entropy_checkpointing",
    "model.override_config.attn_implementation": "model.attn_implementation",
    # verl 0.9's weight sync: its backend's value is mapped (``verl_keys._checkpoint_engine``)
    "rollout.checkpoint_engine.backend": "rollout.weight_sync",
    "rollout.checkpoint_engine.update_weights_bucket_megabytes": "rollout.update_weights_bucket_megabytes",
    "critic.model.enable_gradient_checkpointing": "critic.enable_gradient_checkpointing",
    "critic.model.fsdp_config": "critic.fsdp_config",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep": "trainer.max_ckpt_to_keep",
}

_GPU = "they tune verl's GPU parallelism, memory or speed"
#: verl's ``fsdp_config`` keys skip has no counterpart of (its others: ``FsdpConfig``, the actor's entropy keys).
FSDP_TUNING = [
    "wrap_policy.*", "reshard_after_forward", "fsdp_size",
    "forward_prefetch", "use_orig_params", "seed", "full_determinism", "ulysses_sequence_parallel_size",
    "use_torch_compile", "use_no_sync_for_gradient_accumulation", "pad_to_length", "pad_to_length_bucket",
    "forward_only", "strategy", "qat.*", "turbo_config.*",
]  # fmt: skip
_LOGS = "verl's own logging and files: skip logs with trainer.logger, and skip.rollout keeps every rollout"
#: Keys (patterns over skip's paths) that change nothing computed here, and why.
UNUSED: dict[str, str] = {
    **dict.fromkeys(
        [
            "*micro_batch_size_per_gpu",
            "rollout.log_prob_micro_batch_size",  # verl's deprecated spelling of its _per_gpu twin
            "reward_model.use_dynamic_bsz",
            "reward_model.*max_token_len*",
            *(f"*.fsdp_config.{key}" for key in FSDP_TUNING),
            "*.ulysses_sequence_parallel_size",
            "*.use_remove_padding",
            "reward_model.model.enable_gradient_checkpointing",
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
            "*.megatron.tensor_model_parallel_size",
            "*.data_parallel_size",
            "*.expert_parallel_size",
            "*.pipeline_model_parallel_size",
            "*.trust_remote_code",
            "trainer.ray_wait_register_center_timeout",
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
    "model.lora.merge": "skip's engines always get the merged weights W + (alpha / rank) B A, as with merge=true",
    "model.lora.*": "verl's Megatron LoRA, read only with model.lora.rank > 0, which skip refuses",
    "actor.use_prefix_grouper": "the same log-probs, the prompt's attention shared by its samples: speed",
    **dict.fromkeys(
        ["distillation.teacher_models.*.inference.*", "distillation.teacher_models.*.num_replicas"],
        "the teacher's inference engine: skip's teacher is a model the policy worker holds",
    ),
    "distillation.teacher_key": "it routes rows between teachers, and skip distills from one",
    "distillation.teacher_models.*.key": "it routes rows between teachers, and skip distills from one",
    **dict.fromkeys(
        ["distillation.distillation_loss.topk", "distillation.distillation_loss.log_prob_min_clamp"],
        "verl reads it with loss_mode=forward_kl_topk, which skip refuses",
    ),
    "trainer.balance_batch": "skip's actor is one data-parallel rank: there is nothing to balance",
    "trainer.use_legacy_worker_impl": "it picks between verl's own worker implementations; skip's are its own",
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
    "model.lora.rank": (
        0,
        "model.lora.* is verl's Megatron LoRA; skip's is model.lora_rank, lora_alpha, target_modules",
    ),
    "data.image_key": ("images", "skip reads text prompts only: a row with images is refused"),
    "data.video_key": ("videos", "skip reads text prompts only: a row with videos is refused"),
    "model.lora_adapter_path": (None, "skip's LoRA starts from new adapters (model.lora_rank)"),
    "critic.model.lora_rank": (0, "skip's critic trains every weight (model.lora_rank is the actor's)"),
    "model.external_lib": (None, "skip imports no module a config names"),
    "model.custom_chat_template": (None, "skip renders prompts with model.path's own chat template"),
    "model.tokenizer_path": (None, "skip loads the tokenizer of model.path"),
    "model.hf_config_path": (None, "skip loads model.path's config as it is"),
    "data.tokenizer": (None, "skip loads the tokenizer of model.path"),
    "data.reward_fn_key": ("data_source", "skip picks a row's scorer by its data_source"),
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

#: Keys verl's launch scripts pass that verl 0.9.1 has not either (its Hydra schema refuses them):
#: skip path -> where verl keeps what the script meant.
NOT_VERLS: dict[str, str] = {
    "model.torch_dtype": "the actor's dtype is actor_rollout_ref.actor.fsdp_config.model_dtype",
    "actor.policy_loss.tau_pos": "SAPO's temperatures are actor_rollout_ref.actor.tau_pos and tau_neg",
    "actor.policy_loss.tau_neg": "SAPO's temperatures are actor_rollout_ref.actor.tau_pos and tau_neg",
    "actor.gvpo_beta": "GVPO is verl-recipe's recipe/gvpo for verl 0.6 (its own gvpo_trainer.yaml adds the key)",
}
