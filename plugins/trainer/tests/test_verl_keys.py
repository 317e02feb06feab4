"""verl's key paths under ``skip run``: aliases that land where skip reads them, with whatever
``+``/``++`` prefix they come; GPU-only keys accepted with one warning; algorithm keys skip lacks
refused in one line; and the cache namespace built from the values that train."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from skip_core.cli import cli
from skip_core.config import ConfigError
from skip_core.plugins import registry
from skip_plugin_trainer.commands import compose_config
from skip_plugin_trainer.config.algorithm import RewardConfig
from skip_plugin_trainer.config.settings import RunSettings, UnusedKeysWarning


def settings(*overrides: str, config_dir=None) -> RunSettings:
    return RunSettings.from_config(compose_config(config_dir, "run", overrides))


@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_a_verl_path_sets_skips_key_and_the_namespace_follows(prefix):
    """The issue's cases: ++ once trained without the KL loss, and with n=4 under a namespace of N5."""
    s = settings(
        f"{prefix}actor_rollout_ref.rollout.n=8",
        f"{prefix}actor_rollout_ref.actor.use_kl_loss=True",
        f"{prefix}actor_rollout_ref.model.lora_rank=8",
    )
    assert (s.rollout.n, s.actor.use_kl_loss, s.model.lora_rank) == (8, True, 8)
    assert s.namespace.shape == "GBS16_N8_in160_out96"


def test_a_key_under_a_verl_section_leaves_its_other_keys_as_they_were():
    """An engine option under actor_rollout_ref.rollout once replaced the whole aliased section."""
    from skip_plugin_vllm.options import VLLMOptions

    s = settings("+actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs=16")
    assert s.sections[VLLMOptions].max_num_seqs == 16
    assert (s.rollout.n, s.namespace.n, s.rollout.backend) == (4, 4, "hf")


def test_an_interpolation_of_the_shipped_config_follows_the_verl_path():
    """The critic's mini-batch is the actor's (as in verl), also when a script sets the actor's by verl's path."""
    s = settings("actor_rollout_ref.actor.ppo_mini_batch_size=16")
    assert (s.actor.ppo_mini_batch_size, s.critic.ppo_mini_batch_size) == (16, 16)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+critic.model.lora_rank=8"], r"^critic\.model\.lora_rank: not implemented: skip's critic trains every"),
        (["+model.foo=1"], r"^model\.foo: unknown key \(allowed: attn_implementation, enable_gradient_checkpointing, "),
        (["+data.foo=1"], r"^data\.foo: unknown key"),
        (
            ["+actor_rollout_ref.model.lora.rank=8"],
            r"^actor_rollout_ref\.model\.lora\.rank: not implemented: model\.lora\.\* is verl's Megatron LoRA",
        ),
        (
            ["actor_rollout_ref.model.torch_dtype=bfloat16"],
            r"^actor_rollout_ref\.model\.torch_dtype: not a key of verl",
        ),
        (
            ["++actor_rollout_ref.rollout.nn=3"],
            r"^actor_rollout_ref\.rollout\.nn \(skip's rollout\.nn\): unknown key.*",
        ),
        (["+data.gen_batch_size=32"], r"^data\.gen_batch_size: 32 prompts per generation differ"),
        (["data.train_batch_size=0"], r"^data\.train_batch_size: 0 is fully-async's"),
        (["algorithm.kl_ctrl.type=adaptive"], r"^algorithm\.kl_ctrl\.type: not implemented"),
        (["+reward_model.reward_manager=prime"], r"^reward_model\.reward_manager: 'prime' is not implemented"),
        (
            ["+actor_rollout_ref.actor.policy_loss.loss_mode=ppo2"],
            r"^actor_rollout_ref\.actor\.policy_loss\.loss_mode \(skip's actor\.policy_loss\.loss_mode\): "
            r"unknown .ppo2.; registered: bypass_mode, cispo, ",
        ),
        (
            ["algorithm.adv_estimator=optimal_token_baseline"],
            r"^actor\.calculate_sum_pi_squared: optimal_token_baseline needs each token.s sum of squared probabilities",
        ),
        (["algorithm.adv_estimator=gdpo"], r"^algorithm\.gdpo_reward_keys: gdpo normalises the reward's parts"),
        (
            [
                "algorithm.adv_estimator=gdpo",
                "+algorithm.gdpo_reward_keys=[acc,format]",
                "+algorithm.gdpo_reward_weights=[1.0]",
            ],
            r"^algorithm\.gdpo_reward_weights: 1 weights for 2 gdpo_reward_keys$",
        ),
        (["+critic.model.path=/elsewhere"], r"^critic\.model\.path: '/elsewhere' is not implemented"),
        (["+foo.bar=1"], r"^foo: unknown key \(allowed: actor, .*\)"),
    ],
)
def test_a_key_skip_does_not_implement_is_refused_in_one_line_naming_it(overrides, message):
    with pytest.raises(ConfigError, match=message):
        settings(*overrides)


@pytest.mark.parametrize("order", [1, -1], ids=["null second", "null first"])
def test_verls_null_for_one_spelling_leaves_the_key_to_the_other(order):
    """As verl's scripts write them: ppo_micro_batch_size=null (its default) beside the _per_gpu one."""
    pair = (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size=null",
    )
    assert settings(*pair[::order]).actor.ppo_micro_batch_size == 8


def test_verls_deprecated_log_prob_micro_batch_size_is_accepted_and_unused():
    with pytest.warns(UnusedKeysWarning, match=r"actor_rollout_ref\.rollout\.log_prob_micro_batch_size \(they tune"):
        settings("actor_rollout_ref.rollout.log_prob_micro_batch_size=null")


@pytest.mark.parametrize(
    ("backend", "option"),
    [("hf", "rollout.hf.config_overrides"), ("vllm", "rollout.engine_kwargs.vllm.hf_overrides")],
)
def test_verls_override_config_reaches_the_trainer_and_the_engine(backend, option):
    s = settings(
        f"rollout.backend={backend}",
        "+actor_rollout_ref.model.override_config.rms_norm_eps=0.5",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",  # skip's own key for it
    )
    assert s.model.override_config == {"rms_norm_eps": 0.5} and s.model.attn_implementation == "eager"
    section, _, key = option.rpartition(".")
    assert getattr(s.sections[registry().sections[section]], key) == {"rms_norm_eps": 0.5}


def test_the_overlong_buffer_under_the_path_verl_migrates_from():
    s = settings(
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=8",
    )
    assert s.sections[RewardConfig].overlong_buffer.enable and s.sections[RewardConfig].overlong_buffer.len == 8


def test_two_spellings_of_one_key_are_an_error_not_a_race():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.n: sets rollout\.n, which rollout\.n sets too"):
        compose_config(None, "run", ("rollout.n=3", "actor_rollout_ref.rollout.n=5"))


def test_gpu_keys_are_accepted_with_one_warning_that_lists_them_and_change_nothing():
    plain = settings()
    with pytest.warns(UnusedKeysWarning) as told:
        tuned = settings(
            "actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
            "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
            "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        )
    assert len(told) == 1
    text = str(told[0].message)
    assert "actor_rollout_ref.rollout.max_num_batched_tokens" in text and "trainer.n_gpus_per_node" in text
    assert tuned.dump() == plain.dump()


def test_verls_engine_sizing_keys_go_to_the_options_of_the_engine_named():
    tensor, memory = (
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
    )
    vllm = settings("actor_rollout_ref.rollout.name=vllm", f"{tensor}=2", f"{memory}=0.7").dump()
    engine = vllm["rollout"]["engine_kwargs"]["vllm"]
    assert (engine["tensor_parallel_size"], engine["gpu_memory_utilization"]) == (2, 0.7)
    with pytest.raises(ConfigError, match=rf"^{tensor}: rollout.backend=hf runs each engine on one device"):
        settings(f"{tensor}=2")
    with pytest.warns(UnusedKeysWarning, match=rf"{memory} \(rollout.backend=hf allocates its memory as it generates"):
        settings(f"{tensor}=1", f"{memory}=0.7")


def test_verls_checkpoint_engine_chooses_the_weight_sync():
    engine = "actor_rollout_ref.rollout.checkpoint_engine"
    nccl = settings(f"+{engine}.backend=nccl", f"+{engine}.update_weights_bucket_megabytes=64").dump()["rollout"]
    assert (nccl["weight_sync"], nccl["update_weights_bucket_megabytes"]) == ("group", 64)
    assert settings(f"+{engine}.backend=naive").dump()["rollout"]["weight_sync"] == "auto"
    with pytest.raises(ConfigError, match=rf"^{engine}.backend: 'nixl' is not implemented; allowed: naive \(skip"):
        settings(f"+{engine}.backend=nixl")


def test_verls_memory_and_precision_keys_are_honoured_where_skip_reads_them():
    s = settings(
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.dtype=bf16",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=False",
        "actor_rollout_ref.actor.entropy_from_logits_with_chunking=True",
        "+actor_rollout_ref.actor.fsdp_config.entropy_checkpointing=True",
        "critic.use_dynamic_bsz=True",
        "+critic.model.enable_gradient_checkpointing=False",
    )
    actor = s.actor
    assert (actor.fsdp_config.model_dtype, actor.fsdp_config.compute("cpu")) == ("float32", "bfloat16")
    assert (s.model.enable_gradient_checkpointing, s.model.attn_implementation) == (False, "eager")
    assert (actor.log_prob_budget(), actor.log_prob_budget(reference=True)) == (8192, None)
    assert actor.chunk == 2048 and actor.entropy_checkpointing
    assert s.critic.values_budget() == 32768 and not s.critic.enable_gradient_checkpointing


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+actor_rollout_ref.actor.fsdp_config.dtype=float16", "float16 needs loss scaling"),
        ("actor_rollout_ref.actor.fsdp_config.model_dtype=bf16", None),
        ("+actor_rollout_ref.actor.fsdp_config.dtype=fp64", "fsdp_config.dtype"),
    ],
)
def test_a_precision_skip_cannot_train_in_is_one_line(override, message):
    if message is None:
        assert settings(override).actor.fsdp_config.compute("cuda") == "bfloat16"
        return
    with pytest.raises(ConfigError, match=message) as raised:
        settings(override)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100"],
         "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
        (["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
          "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=100"],
         "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
        (["actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=99"],
         "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
        (["algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=True", "critic.forward_max_token_len_per_gpu=100"],
         "critic.forward_max_token_len_per_gpu"),
    ],
)  # fmt: skip
def test_a_token_budget_that_cannot_hold_one_sample_is_refused_naming_the_key_that_sets_it(overrides, key):
    written = rf"^{re.escape(key)}( \(skip's [a-z_.]+\))?"
    with pytest.raises(ConfigError, match=rf"{written}: \d+ tokens cannot hold one sample"):
        settings(*overrides)


MEMORY_KEYS = (
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384",
    "+actor_rollout_ref.actor.fsdp_config.dtype=bfloat16",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking=True",
)


def test_on_a_gpu_no_memory_key_is_said_to_change_nothing():
    import warnings

    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        s = settings("trainer.device=cuda", "resources.actor.gpus_per_worker=1", *MEMORY_KEYS)
    said = " ".join(str(w.message) for w in told)
    assert not any(key.lstrip("+").split("=")[0] in said for key in MEMORY_KEYS), said
    fsdp = s.actor.fsdp_config
    assert fsdp.param_offload and fsdp.optimizer_offload and s.actor.ref_param_offload
    assert fsdp.compute("cuda") == "bfloat16"


def test_on_the_cpu_the_offload_keys_are_said_to_move_nothing_naming_the_device():
    unused = r"fsdp_config\.param_offload, .*: unused on trainer\.device=cpu"
    with pytest.warns(UnusedKeysWarning, match=unused) as told:
        settings(*MEMORY_KEYS)
    assert len(told) == 1  # the other memory keys are used on the CPU too


def test_fsdps_offload_on_one_rank_is_refused_in_one_line():
    refused = r"offload_policy \(skip's [a-z_.]+\): FSDP2's offload needs resources\.actor\.workers > 1"
    with pytest.raises(ConfigError, match=refused):
        settings("actor_rollout_ref.actor.fsdp_config.offload_policy=True")


def test_an_attention_kernel_is_one_transformers_has_and_flash_attention_needs_a_gpu():
    key = "actor_rollout_ref.model.override_config.attn_implementation"
    with pytest.raises(ConfigError, match=r"expected 'sdpa', 'eager', 'flash_attention_2', .* got 'flash'"):
        settings(f"+{key}=flash")
    with pytest.raises(ConfigError, match=rf"^{key}: flash_attention_2 runs on a GPU only \(trainer.device=cpu"):
        settings(f"+{key}=flash_attention_2")
    assert settings(f"+{key}=eager").model.attn_implementation == "eager"


def test_verls_renamed_keys_land_on_skips():
    s = settings(
        "algorithm.kl_ctrl.kl_coef=0.05",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "+reward_model.overlong_buffer.enable=True",
        "+reward_model.overlong_buffer.len=8",
        "+reward_model.reward_manager=dapo",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "+actor_rollout_ref.actor.clip_ratio=0.3",
    )
    assert s.algorithm.kl_coef == 0.05 and s.rollout.backend == "vllm" and s.rollout.multi_turn.max_turns == 2
    assert s.reward.overlong_buffer.enable and s.reward.overlong_buffer.len == 8
    assert s.actor.ppo_micro_batch_size == 8
    assert (s.actor.clip_ratio_low, s.actor.clip_ratio_high) == (0.3, 0.3)


def test_dapos_generation_batch_draws_more_prompts_than_a_step_trains():
    s = settings("+data.gen_batch_size=32", "algorithm.filter_groups.enable=true")
    assert (s.generation_batch_size, s.train_batch_size) == (32, 16)
    assert s.namespace.gbs == 32


def test_fully_asyncs_zero_batch_is_an_update_of_mini_batches():
    with pytest.warns(
        UserWarning, match=r"sets trainer\.total_training_steps to 4 \(64 prompts / 16 per update\), not 20"
    ):
        s = fully_async_settings()
    assert s.train_batch_size == 2 * s.actor.ppo_mini_batch_size == 16
    assert s.trainer.total_training_steps == 64 // 16
    assert s.namespace.gbs == 1  # verl's fully-async namespace: GBS1


def fully_async_settings() -> RunSettings:
    return settings(
        "trainer.schedule=fully_async",
        "data.train_batch_size=0",
        "+data.gen_batch_size=1",
        "async_training.require_batches=2",
        "+rollout.total_rollout_steps=64",
    )


def test_a_users_verl_shaped_yaml_is_read_through_the_same_aliases(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - run\n  - _self_\n"
        "actor_rollout_ref:\n  rollout:\n    n: 8\n  actor:\n    ppo_mini_batch_size: 16\n"
    )
    s = RunSettings.from_config(compose_config(tmp_path, "mine", ()))
    assert (s.rollout.n, s.actor.ppo_mini_batch_size, s.namespace.n) == (8, 16, 8)


def test_a_null_task_says_its_options_are_unused():
    with pytest.warns(UnusedKeysWarning, match=r"task\.train_size.*unused with task\.name=null"):
        s = settings("task.name=null")
    assert s.task.name is None


def test_check_prints_the_resolved_settings_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        cli, ["run", "--check", "actor_rollout_ref.rollout.n=8", f"trainer.default_local_dir={run_dir}"]
    )
    assert result.exit_code == 0, result.output
    assert re.search(r"^rollout:\n(  .*\n)*  n: 8$", result.output, re.M)
    assert "\n# weight sync: through Ray's object store (rollout.weight_sync=auto: " in result.output
    assert not run_dir.exists()


def test_check_stops_in_the_one_line_a_run_would():
    result = CliRunner().invoke(cli, ["run", "--check", "algorithm.kl_ctrl.type=adaptive"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: algorithm.kl_ctrl.type: not implemented: skip's in-reward KL coefficient is fixed (algorithm.kl_coef) "
        "(verl's default is 'fixed')"
    ]


def test_cfg_job_prints_the_composed_config_as_hydra_does():
    result = CliRunner().invoke(cli, ["run", "--cfg", "job", "rollout.n=8"])
    assert result.exit_code == 0, result.output
    assert re.search(r"^  dir: \$\{trainer\.default_local_dir\}/profile$", result.output, re.M)  # unresolved, as Hydra
    assert re.search(r"^  'n': 8$", result.output, re.M)  # OmegaConf quotes YAML 1.1's boolean n


def test_a_custom_reward_function_is_loaded_from_the_file_verl_names(tmp_path):
    from skip_plugin_trainer.reward import Rewarder, _score

    source = tmp_path / "my_reward.py"
    source.write_text(
        "def judge(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str == ground_truth), 'acc': 1}\n"
    )
    s = settings(f"+custom_reward_function.path={source}", "+custom_reward_function.name=judge")  # verl 0.9's place
    assert s.reward.custom_reward_function.path == str(source)
    rewarder = Rewarder(s.reward, tokenizer=None, max_response_length=96)
    assert _score(rewarder.fn("any", "42", "42", {})) == 1.0
    assert _score(rewarder.fn("any", "41", "42", {})) == 0.0
    rewarder.check_sources({"a source no task knows"}, "data.train_files")  # the user's function scores any row


@pytest.mark.parametrize(
    ("path", "name", "message"),
    [
        ("missing.py", "compute_score", r"custom_reward_function\.path: no such file '.*missing\.py' \(relative"),
        ("reward.txt", "compute_score", r"custom_reward_function\.path: expected a Python file \(\.py\)"),
        ("my_reward.py", "absent", r"custom_reward_function\.name: .* has no 'absent'$"),
        ("my_reward.py", "SCALE", r"custom_reward_function\.name: 'SCALE' in .* is not a function$"),
        ("broken.py", "compute_score", r"custom_reward_function\.path: importing .* failed: ZeroDivisionError"),
    ],
)
def test_a_custom_reward_function_that_cannot_load_is_one_line(tmp_path, path, name, message):
    from skip_plugin_trainer.reward import Rewarder

    (tmp_path / "my_reward.py").write_text("SCALE = 2\n\ndef compute_score(*args):\n    return 0.0\n")
    (tmp_path / "reward.txt").write_text("def compute_score(*args):\n    return 0.0\n")
    (tmp_path / "broken.py").write_text("1 / 0\n")
    s = settings(
        f"+reward.custom_reward_function.path={tmp_path / path}", f"+reward.custom_reward_function.name={name}"
    )
    with pytest.raises(ConfigError, match=message):
        Rewarder(s.reward, tokenizer=None, max_response_length=96)


def test_skip_rollout_checks_as_skip_run_does():
    result = CliRunner().invoke(cli, ["rollout", "--check", "actor_rollout_ref.rollout.n=2", "steps=1..3"])
    assert result.exit_code == 0, result.output
    assert re.search(r"^steps:\n- 1\.\.3$", result.output, re.M)
    bad = CliRunner().invoke(cli, ["rollout", "--check", "+actor_rollout_ref.rollout.nn=2"])
    assert bad.exit_code == 1 and bad.output.startswith("Error: actor_rollout_ref.rollout.nn (skip's rollout.nn)")


def test_chat_template_kwargs_reach_every_rendering(task_dir):
    """verl's ``data.apply_chat_template_kwargs`` (Qwen3 scripts pass enable_thinking=false):
    the dataset's prompts and the agent loop's pieces are rendered with them."""
    from skip_plugin_trainer.data.chat import ChatFormat
    from transformers import AutoTokenizer

    s = settings("+data.apply_chat_template_kwargs.enable_thinking=false")
    assert s.data.apply_chat_template_kwargs == s.rollout.chat_template_kwargs == {"enable_thinking": False}
    tokenizer = AutoTokenizer.from_pretrained(task_dir / "model")
    tokenizer.chat_template = (
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    messages = [{"role": "user", "content": "2+2?"}]
    assert ChatFormat(tokenizer, s.data.apply_chat_template_kwargs).render(messages) == "<no-think>user: 2+2?\n"
    assert ChatFormat(tokenizer).render(messages) == "user: 2+2?\n"


def test_no_section_drops_a_key_it_does_not_declare():
    """Every declared section and every skip.<role>, and every model nested in them, refuses an
    unknown key (pydantic's default would drop it); only ``task`` takes its task's options, which
    the task's own ``Options`` validates."""
    import typing

    from pydantic import BaseModel
    from skip_core.plugins import registry

    def models(model: type[BaseModel]):
        yield model
        for field in model.model_fields.values():
            for kind in (field.annotation, *typing.get_args(field.annotation)):
                if isinstance(kind, type) and issubclass(kind, BaseModel):
                    yield from models(kind)

    found = registry()
    roots = [*found.sections.values(), *(role.config for role in found.roles.values())]
    lax = {model.__name__ for root in roots for model in models(root) if model.model_config.get("extra") != "forbid"}
    assert lax == {"TaskConfig"}


def test_verls_merged_lora_sync_is_what_skip_always_does():
    with pytest.warns(UnusedKeysWarning, match=r"actor_rollout_ref\.model\.lora\.merge \(skip's engines always get"):
        settings("+actor_rollout_ref.model.lora.merge=True", "actor_rollout_ref.model.lora.alpha=64")


def test_lora_keys_without_a_rank_are_said_to_be_unused():
    with pytest.warns(UnusedKeysWarning, match=r"model\.lora_alpha: unused with model\.lora_rank=0"):
        settings("actor_rollout_ref.model.lora_alpha=32")


def test_lora_targets_that_match_no_layer_stop_the_check_in_one_line(task_dir):
    args = ["run", "--check", f"task.dir={task_dir}", "task.train_size=64", "task.val_size=8", "task.warmup_steps=5"]
    result = CliRunner().invoke(cli, [*args, "model.lora_rank=4", "model.target_modules=[nowhere_proj]"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: model.target_modules: Target modules {'nowhere_proj'} not found")
    assert CliRunner().invoke(cli, [*args, "model.lora_rank=4", "model.target_modules=[q_proj,v_proj]"]).exit_code == 0
