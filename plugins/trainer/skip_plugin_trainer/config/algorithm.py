"""The sections of the learning side of ``skip run``, with verl's key names: ``reward``,
``actor``, ``critic`` and ``algorithm``. ``settings.py`` gathers them with the rest and
cross-checks them; this module imports only their base (``sections.Section``) of the trainer.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from skip_plugin_trainer.config.sections import Section

KlType = Literal["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"]


class OverlongBuffer(Section):
    """DAPO's overlong reward shaping: a response longer than ``data.max_response_length - len``
    tokens loses ``penalty_factor`` x its excess / ``len`` (at most ``penalty_factor``, at the cap)."""

    enable: bool = False
    len: PositiveInt = 4096
    penalty_factor: NonNegativeFloat = 1.0


class CustomRewardFunction(Section):
    """``reward.custom_reward_function``, verl's: the function ``name`` of the Python file ``path``,
    with verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)`` signature,
    returning a score or a dict holding one under ``score``. It is the user's own code, run
    because they named it; it replaces ``reward.function``."""

    path: str | None = None
    name: str = "compute_score"


class RewardConfig(Section):
    """``reward``: which function scores responses; ``tool_rewards`` adds the tools' own rewards.

    ``timeout_s``: how long one call of the function may take; a sample whose call runs longer
    scores 0, as in verl's PRIME reward manager, and is counted in ``reward/timeouts``.
    ``manager``: verl's reward manager (``reward.reward_manager.name``). ``naive`` and ``dapo``
    score alike (``dapo`` with the overlong buffer); ``gdpo`` also gives the function
    ``extra_info["experiment_name"]`` (``trainer.experiment_name``), as verl's GDPO manager does."""

    function: str = "task"
    manager: Literal["naive", "dapo", "gdpo"] = "naive"
    custom_reward_function: CustomRewardFunction = CustomRewardFunction()
    timeout_s: PositiveFloat = 60.0
    tool_rewards: bool = True
    overlong_buffer: OverlongBuffer = OverlongBuffer()


class Optim(Section):
    """``actor.optim`` / ``critic.optim``: AdamW, and verl's learning-rate schedule, which moves
    once per update (one training step).

    ``lr_warmup_steps``: updates of linear warm-up from lr 0; -1 or 0 take ``lr_warmup_steps_ratio``.
    ``lr_warmup_steps_ratio``: the warm-up as a fraction of the run's training steps, rounded down.
    ``lr_scheduler_type``: after the warm-up, ``constant`` lr or a ``cosine`` decay until the last step.
    ``warmup_style``: verl's deprecated name of ``lr_scheduler_type``; given, it replaces it.
    ``min_lr_ratio``: the floor of the cosine decay, as a fraction of ``lr``.
    ``num_cycles``: cosine waves over the decay; 0.5 is one half-wave from ``lr`` down to the floor.
    """

    lr: float = Field(1e-5, gt=0, le=1)  # an AdamW step past 1 is a typo (verl's: 1e-6 to 1e-5)
    weight_decay: NonNegativeFloat = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8
    lr_warmup_steps: int = Field(-1, ge=-1)
    lr_warmup_steps_ratio: float = Field(0.0, ge=0, le=1)
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    warmup_style: Literal["constant", "cosine"] | None = None
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    num_cycles: float = 0.5

    @model_validator(mode="before")
    @classmethod
    def _verl_defaults(cls, values: Any) -> Any:
        """As verl's optimizer config: a null ``min_lr_ratio`` or ``lr_warmup_steps`` is the default,
        and a valid ``warmup_style`` wins over ``lr_scheduler_type``."""
        if not isinstance(values, dict):
            return values
        values = {k: v for k, v in values.items() if v is not None or k not in ("min_lr_ratio", "lr_warmup_steps")}
        if values.get("warmup_style") in ("constant", "cosine"):
            values["lr_scheduler_type"] = values["warmup_style"]
        return values


Dtype = Literal["float32", "bfloat16"]
#: verl's spellings of a dtype (``fp32`` is its ``model_dtype`` default, ``bfloat16`` its ``dtype``'s).
_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}


OFFLOAD_KEYS = ("param_offload", "optimizer_offload", "offload_policy")


class FsdpConfig(Section):
    """``actor.fsdp_config`` / ``critic.fsdp_config``: the precision a model trains in, with verl's keys.

    ``model_dtype``: the master weights, their gradients and AdamW's state (verl's default fp32).
    ``dtype``: what forward and backward compute in: with several ranks FSDP2's mixed precision
    (parameters gathered in it, gradients reduced in float32), on one rank autocast. Null: bfloat16
    on a GPU, as verl; on the CPU ``model_dtype``, where bfloat16 is slower and only one key away.
    ``param_offload`` / ``optimizer_offload``: the weights (with gradients) / AdamW's state wait in
    host memory between the calls that use them; ``offload_policy``: FSDP2's own offload, the
    shards on the host and each unit copied to the GPU for its pass (``train/offload.py``).
    """

    model_dtype: Dtype = "float32"
    dtype: Dtype | None = None
    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False

    @field_validator("model_dtype", "dtype", mode="before")
    @classmethod
    def _spelling(cls, value: Any) -> Any:
        if value in ("fp16", "float16"):
            raise ValueError("float16 needs loss scaling, which skip does not do: use bfloat16 or float32")
        return _DTYPES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _narrower(self) -> FsdpConfig:
        if self.dtype == "float32" and self.model_dtype == "bfloat16":
            raise ValueError("dtype: float32 compute over bfloat16 weights gains nothing; set model_dtype=fp32")
        return self

    def compute(self, device: str) -> str:
        """The compute dtype on ``device`` (``dtype``, its null resolved)."""
        return self.dtype or ("bfloat16" if device == "cuda" else self.model_dtype)


LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]


class PolicyLossConfig(Section):
    """``actor.policy_loss``, verl's: ``loss_mode`` names a registered policy loss (``skip
    plugins`` lists them; verl's twelve are built in), the rest are the options of some of them:
    Clip-Cov drops the gradient of ``clip_cov_ratio`` of the tokens whose advantage/log-prob
    covariance lies between ``clip_cov_lb`` and ``clip_cov_ub``; KL-Cov penalises
    ``kl_cov_ratio`` of them by ``ppo_kl_coef`` x |log-ratio|; DRO's quadratic penalty is
    ``dro_beta``, which it needs. ``bypass_mode`` is verl's name of the loss of
    ``algorithm.rollout_correction.bypass_mode=true``, which it turns on."""

    loss_mode: str = "vanilla"
    clip_cov_ratio: PositiveFloat = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: PositiveFloat = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: PositiveFloat | None = None

    @model_validator(mode="after")
    def _dro(self) -> PolicyLossConfig:
        if self.loss_mode == "dro" and self.dro_beta is None:
            raise ValueError("dro_beta: loss_mode=dro needs a positive value (verl has no default)")
        return self


class ActorConfig(Section):
    """``actor``: the PPO update, with verl's key names.

    ``ppo_mini_batch_size`` counts prompts per optimizer step (each with ``rollout.n``
    samples); ``ppo_micro_batch_size`` counts samples per forward/backward pass, whose
    gradients accumulate over the mini-batch.

    ``use_dynamic_bsz``: micro-batches packed to ``ppo_max_token_len_per_gpu`` tokens instead of
    ``ppo_micro_batch_size`` rows. skip's forward pass computes a micro-batch's rows over their
    longest prompt and response (padding included), so that is what a budget counts; each must
    hold the longest sample (data.max_prompt_length + data.max_response_length), as verl asserts.
    The loss divides by the mini-batch's totals, so the gradient does not depend on the split.
    The log-prob passes (no gradient) take ``log_prob_use_dynamic_bsz`` and
    ``log_prob_max_token_len_per_gpu`` (verl's ``rollout.`` keys; null: the update's), the
    reference's ``ref_log_prob_*`` (verl's ``ref.log_prob_*``; null: the log-prob pass's);
    ``ref_param_offload`` (verl's ``ref.fsdp_config.param_offload``) keeps the reference in host
    memory but while it computes.
    ``policy_loss`` picks the loss (``PolicyLossConfig``); ``loss_agg_mode`` how it is reduced
    (verl's five modes; ``loss_scale_factor`` divides ``seq-mean-token-sum-norm``, null: by the
    response width); ``tau_pos`` / ``tau_neg`` are SAPO's gate temperatures.
    ``calculate_sum_pi_squared``: the old log-prob pass also gives each token's sum of squared
    probabilities, which the optimal token baselines need (verl's key: they refuse to run without it).
    ``entropy_from_logits_with_chunking`` takes log-probs and entropy ``entropy_from_logits_chunk_size``
    tokens at a time, so no [tokens x vocabulary] float32 tensor is whole; ``entropy_checkpointing``
    recomputes each chunk in the backward pass instead of keeping it.
    """

    ppo_mini_batch_size: PositiveInt = 16
    ppo_micro_batch_size: PositiveInt = 16
    ppo_epochs: PositiveInt = 1
    clip_ratio_low: NonNegativeFloat = 0.2
    clip_ratio_high: NonNegativeFloat = 0.2
    clip_ratio_c: float | None = Field(3.0, gt=1)
    loss_agg_mode: LossAggMode = "token-mean"
    loss_scale_factor: PositiveFloat | None = None
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    tau_pos: PositiveFloat = 1.0
    tau_neg: PositiveFloat = 1.05
    calculate_sum_pi_squared: bool = False
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: NonNegativeFloat = 0.001
    kl_loss_type: KlType = "low_var_kl"
    grad_clip: PositiveFloat | None = 1.0
    optim: Optim = Optim()
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: PositiveInt = 16384
    fsdp_config: FsdpConfig = FsdpConfig()
    log_prob_use_dynamic_bsz: bool | None = None
    log_prob_max_token_len_per_gpu: PositiveInt | None = None
    ref_log_prob_use_dynamic_bsz: bool | None = None
    ref_log_prob_max_token_len_per_gpu: PositiveInt | None = None
    ref_param_offload: bool = False
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: PositiveInt = 2048
    entropy_checkpointing: bool = False

    def log_prob_budget(self, reference: bool = False) -> int | None:
        """Tokens per micro-batch of a log-prob pass (the reference's with ``reference``), or None
        for ``ppo_micro_batch_size`` rows."""
        dynamic = _first(self.log_prob_use_dynamic_bsz, self.use_dynamic_bsz)
        budget = _first(self.log_prob_max_token_len_per_gpu, self.ppo_max_token_len_per_gpu)
        if reference:
            dynamic = _first(self.ref_log_prob_use_dynamic_bsz, dynamic)
            budget = _first(self.ref_log_prob_max_token_len_per_gpu, budget)
        return budget if dynamic else None

    def budgets(self) -> dict[str, int]:
        """The token budgets in use, each under the key its value comes from."""
        chain = ["ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu", "ref_log_prob_max_token_len_per_gpu"]
        used = {chain[0]: self.ppo_max_token_len_per_gpu} if self.use_dynamic_bsz else {}
        for reference, depth in ((False, 2), (True, 3)):
            budget = self.log_prob_budget(reference)
            if budget is not None:
                used[next(key for key in reversed(chain[:depth]) if getattr(self, key) is not None)] = budget
        return used

    @property
    def chunk(self) -> int | None:
        return self.entropy_from_logits_chunk_size if self.entropy_from_logits_with_chunking else None


def _first(value: Any, default: Any) -> Any:
    return default if value is None else value


class CriticConfig(Section):
    """``critic``: the value model of ``algorithm.adv_estimator=gae``, with verl's key names: the
    policy's architecture with a one-output head, trained beside it on its own optimizer.
    Batch sizes count as the actor's do; ``cliprange_value`` bounds how far one update moves a
    value from the one the advantages used."""

    ppo_mini_batch_size: PositiveInt = 16
    ppo_micro_batch_size: PositiveInt = 16
    ppo_epochs: PositiveInt = 1
    cliprange_value: PositiveFloat = 0.5
    loss_agg_mode: LossAggMode = "token-mean"
    grad_clip: PositiveFloat | None = 1.0
    optim: Optim = Optim()
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: PositiveInt = 32768
    forward_max_token_len_per_gpu: PositiveInt | None = None
    fsdp_config: FsdpConfig = FsdpConfig()
    enable_gradient_checkpointing: bool = True

    def values_budget(self) -> int | None:
        if not self.use_dynamic_bsz:
            return None
        return _first(self.forward_max_token_len_per_gpu, self.ppo_max_token_len_per_gpu)

    def budgets(self) -> dict[str, int]:
        if not self.use_dynamic_bsz:
            return {}
        forward = "forward_max_token_len_per_gpu" if self.forward_max_token_len_per_gpu is not None else None
        return {"ppo_max_token_len_per_gpu": self.ppo_max_token_len_per_gpu} | (
            {forward: self.forward_max_token_len_per_gpu} if forward else {}
        )


class RolloutCorrection(Section):
    """``algorithm.rollout_correction``, verl's keys: how PPO treats samples whose engine log-probs
    (the behaviour policy) differ from the trainer's, as they do when generation runs on older weights.

    ``bypass_mode``: use the rollout log-probs as PPO's old log-probs (no recomputation); null
    means on for overlapped schedules, off for ``sync``. Off, old log-probs are recomputed and
    ``rollout_is`` (``token`` or ``sequence``) weights each token's loss by the importance ratio
    old / rollout, truncated at ``rollout_is_threshold`` (a ``lower_upper`` string zeroes the
    weights outside [lower, upper] instead, verl's IcePop; null computes none). On, the ratio is
    the current policy's / the rollout's, taken in the loss: ``loss_type=ppo_clip`` clips it as
    PPO does (weights are then only measured), ``reinforce`` is the policy gradient weighted by
    them. ``rollout_rs`` rejects the tokens or whole sequences whose divergence leaves the bounds
    of ``rollout_rs_threshold``; ``rollout_is_batch_normalize`` scales the weights to mean 1.

    What is refused is what verl refuses, where verl reads a key: a threshold only once its
    option is on. ``check`` (from ``RunSettings.check_sizes``) refuses before the first step.
    """

    bypass_mode: bool | None = None
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    rollout_is: Literal["token", "sequence"] | None = None
    rollout_is_threshold: float | str | bool | None = 2.0  # bool only to refuse it, as verl does
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | bool | None = None

    def check(self) -> None:
        """Raise ``ValueError("<key>: <why>")`` where verl would refuse these settings."""
        self.is_bounds()
        self.rs_bounds()

    def is_bounds(self) -> tuple[float, float | None] | None:
        """(upper, lower) of ``rollout_is_threshold``: lower None for one number (truncation), set
        for ``lower_upper`` (IcePop). None when no weights are computed (either key null)."""
        if self.rollout_is is None or self.rollout_is_threshold is None:
            return None
        try:
            lower, upper = self.bounds(self.rollout_is_threshold)
        except ValueError as exc:
            raise ValueError(f"rollout_is_threshold: {exc}") from None
        return upper, lower

    def rs_options(self) -> list[str]:
        """``rollout_rs``'s comma-separated options, duplicates dropped, as verl reads them: the
        divergence k1 = -log r, k2 = (log r)^2 / 2 or k3 = r - 1 - log r (r = policy / rollout)
        of each token, or its sum, mean or max over a sequence."""
        known = [f"{level}_k{k}" for level in ("token", "seq_sum", "seq_mean") for k in (1, 2, 3)]
        known += ["seq_max_k2", "seq_max_k3"]
        if self.rollout_rs is None:
            return []
        options = list(dict.fromkeys(part.strip() for part in self.rollout_rs.split(",") if part.strip()))
        if not options or any(option not in known for option in options):
            bad = next((option for option in options if option not in known), self.rollout_rs)
            expected = ", ".join(known)
            raise ValueError(f"rollout_rs: unknown option {bad!r} (expected any of {expected}, comma-separated)")
        return options

    def rs_bounds(self) -> dict[str, tuple[float | None, float]]:
        """Each ``rollout_rs`` option's (lower, upper) bounds on its statistic: a k1 option takes
        ``lower_upper`` or one number, its upper (the lower then 1 / upper), and is kept where
        log(lower) <= k1 <= log(upper); k2 and k3 take an upper bound alone. One threshold serves
        every option, or one each, comma-separated."""
        options, spec = self.rs_options(), self.rollout_rs_threshold
        if not options:
            return {}
        if spec is None:
            raise ValueError(f"rollout_rs_threshold: required with rollout_rs={self.rollout_rs} (verl has no default)")
        parts = [spec] if not isinstance(spec, str) else [part.strip() for part in spec.split(",") if part.strip()]
        if len(parts) not in (1, len(options)):
            raise ValueError(
                f"rollout_rs_threshold: {len(parts)} thresholds for {len(options)} rollout_rs options "
                "(one for all, or one each)"
            )
        bounds = {}
        for option, part in zip(options, parts * len(options) if len(parts) == 1 else parts, strict=True):
            k1 = option.endswith("k1")
            if not k1 and "_" in str(part):
                raise ValueError(f"rollout_rs_threshold: {option} takes an upper bound alone, got {part!r}")
            try:
                lower, upper = self.bounds(part)
                if k1 and lower is None and 1.0 / upper > upper:
                    raise ValueError(f"{upper} alone is an upper bound below its implied lower 1/{upper}")
            except ValueError as exc:
                raise ValueError(f"rollout_rs_threshold: {exc} for {option}") from None
            bounds[option] = ((1.0 / upper if lower is None else lower) if k1 else None, upper)
        return bounds

    @staticmethod
    def bounds(spec: float | str | bool) -> tuple[float | None, float]:
        """(lower, upper) of a threshold, verl's reading: a positive number or float-like string is
        the upper bound alone; ``lower_upper`` both, positive and in order."""
        if isinstance(spec, bool) or (isinstance(spec, str) and not spec.strip()):
            raise ValueError(f"expected a positive number or 'lower_upper', got {spec!r}")
        text = str(spec).strip()
        lower_text, _, upper_text = text.partition("_") if "_" in text else ("", "", text)
        try:
            lower, upper = (float(lower_text) if lower_text else None), float(upper_text)
        except ValueError:
            raise ValueError(f"expected a positive number or 'lower_upper', got {spec!r}") from None
        if not upper > 0 or (lower is not None and not lower > 0):
            raise ValueError(f"expected positive bounds, got {spec!r}")
        if lower is not None and lower > upper:
            raise ValueError(f"lower bound above the upper one in {spec!r}")
        return lower, upper


class FilterGroups(Section):
    """``algorithm.filter_groups``: DAPO's dynamic sampling. Groups whose ``metric`` is the same
    for every sample are dropped and more prompts generated until the batch is full, at most
    ``max_num_gen_batches`` generations a step (0: no limit). ``acc`` (verl's name) and
    ``score`` read the reward function's score, ``seq_reward`` the whole reward."""

    enable: bool = False
    metric: Literal["acc", "score", "seq_reward"] = "acc"
    max_num_gen_batches: NonNegativeInt = 0


class AlgorithmConfig(Section):
    """``algorithm``: the advantage estimator (``gae`` trains a critic) and the optional KL
    penalty in the reward; ``gamma`` and ``lam`` are GAE's discount and trace decay.
    ``gdpo_reward_keys``: GDPO's reward parts, keys of the dict the reward function returns.
    ``gdpo_reward_weights``: their weights in GDPO's sum, one per key (null: 1 each)."""

    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = Field(1.0, ge=0, le=1)
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KlType = "kl"
    kl_coef: NonNegativeFloat = 0.001
    filter_groups: FilterGroups = FilterGroups()
    rollout_correction: RolloutCorrection = RolloutCorrection()
    gdpo_reward_keys: tuple[str, ...] | None = None
    gdpo_reward_weights: tuple[float, ...] | None = None
