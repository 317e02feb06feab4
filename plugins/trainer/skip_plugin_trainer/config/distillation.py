"""``distillation``, verl's section of on-policy distillation, with verl's keys and defaults: which
teacher, and how its divergence from the student is estimated and trained on
(``algorithms/distillation.py`` computes the loss)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, ValidationInfo, field_validator

from skip_plugin_trainer.config.sections import Section


class DistillationLoss(Section):
    """``distillation.distillation_loss``: verl's keys and defaults."""

    loss_mode: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "k3"
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: PositiveFloat | None = None
    use_policy_gradient: bool = Field(False, validate_default=True)
    policy_loss_mode: Literal["vanilla"] = "vanilla"  # the only one verl 0.9.1 allows here
    clip_ratio: NonNegativeFloat = 0.2
    clip_ratio_low: NonNegativeFloat | None = 0.2
    clip_ratio_high: NonNegativeFloat | None = 0.2

    @field_validator("loss_mode", mode="before")
    @classmethod
    def _an_estimator(cls, mode: object) -> object:
        if mode == "forward_kl_topk":
            raise ValueError(
                "forward_kl_topk is not implemented: it needs the teacher's top-k log-probs at every position, which "
                "verl's teacher engine gives and skip's teacher forward does not keep; use an estimator such as k3"
            )
        return mode

    @field_validator("use_policy_gradient")
    @classmethod
    def _k1_needs_it(cls, use: bool, info: ValidationInfo) -> bool:
        mode = info.data.get("loss_mode")
        if mode in ("k1", "kl") and not use:  # verl refuses k1 (its alias kl slips past its check)
            raise ValueError(
                f"loss_mode={mode}'s gradient does not depend on the teacher's log-probs, so it cannot be "
                "backpropagated directly: set use_policy_gradient=true, or use loss_mode=k3"
            )
        return use


class TeacherModel(Section):
    """One of ``distillation.teacher_models``: the teacher's weights. verl's ``key`` (routing
    rows between teachers) and ``inference`` (its engine) change nothing here."""

    model_path: str | None = None


class DistillationConfig(Section):
    """``distillation``, verl's section: off unless ``enabled``."""

    enabled: bool = False
    distillation_loss: DistillationLoss = DistillationLoss()
    teacher_models: dict[str, TeacherModel] = Field(default_factory=dict, validate_default=True)

    @field_validator("teacher_models")
    @classmethod
    def _one_teacher(cls, teachers: dict[str, TeacherModel], info: ValidationInfo) -> dict[str, TeacherModel]:
        if not info.data.get("enabled"):
            return teachers
        if len(teachers) != 1:
            raise ValueError(
                f"skip distills from one teacher, got {len(teachers)} (routing rows between teachers is not "
                "implemented); give one teacher_models.<name>.model_path"
            )
        if not next(iter(teachers.values())).model_path:
            raise ValueError(f"the teacher {next(iter(teachers))!r} has no model_path")
        return teachers

    @property
    def teacher_path(self) -> str | None:
        return next(iter(self.teacher_models.values())).model_path if self.enabled else None
