"""The config sections of the two training steps, `pretrain` and `finetune`, of `PlatformConfig`
(`pipelines.common.config`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from sapiens2.config_section import ConfigSection
from sapiens2.model.config import ARCHS
from sapiens2.pretrain.config import ObjectiveConfig
from sapiens2.tasks.registry import TASK_NAMES
from sapiens2.train.config import CheckpointSection, DeepSpeedSection, FinetuneOptimSection, OptimSection

PRETRAIN_MICRO_BATCH = 8


def check_task_names(per_task: dict[str, Any]) -> None:
    unknown = sorted(set(per_task) - set(TASK_NAMES))
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; expected some of {TASK_NAMES}")


class TrainingSection(ConfigSection):
    """A training step's section: its lr warmup must fit inside its shortest run."""

    @model_validator(mode="after")
    def _warmup_fits(self):
        shortest = min([self.steps, *getattr(self, "task_steps", {}).values()])
        if self.optim.warmup_steps > shortest:
            raise ValueError(f"optim.warmup_steps ({self.optim.warmup_steps}) exceeds steps ({shortest})")
        return self


class PretrainConfig(TrainingSection):
    """Self-supervised pretraining of the backbone: MAE + CLS self-distillation under DeepSpeed."""

    arch: str = "sapiens2_tiny"
    steps: int = Field(300, ge=1, description="optimizer steps")
    seed: int = 0
    log_every: int = Field(10, ge=1)
    objective: ObjectiveConfig = ObjectiveConfig()
    deepspeed: DeepSpeedSection = DeepSpeedSection(micro_batch_size=PRETRAIN_MICRO_BATCH)
    optim: OptimSection = OptimSection(lr=1.5e-3, weight_decay=0.05, warmup_steps=30, schedule="cosine")
    checkpoint: CheckpointSection = CheckpointSection(every_n_steps=100, keep_last=2)

    @field_validator("deepspeed", mode="before")
    @classmethod
    def _contrastive_batch_default(cls, value: Any) -> Any:
        # A section given without a micro-batch keeps pretraining's default, not DeepSpeed's 1:
        # the CLS and KoLeo terms compare the images of a micro-batch with each other.
        if isinstance(value, dict) and "micro_batch_size" not in value:
            return {"micro_batch_size": PRETRAIN_MICRO_BATCH, **value}
        return value

    @model_validator(mode="after")
    def _koleo_has_neighbours(self) -> PretrainConfig:
        if self.objective.koleo_weight > 0 and self.deepspeed.micro_batch_size < 2:
            raise ValueError("objective.koleo_weight > 0 needs deepspeed.micro_batch_size >= 2 "
                             "(KoLeo measures each CLS feature's nearest neighbour in the micro-batch)")
        return self

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, arch: str) -> str:
        if arch not in ARCHS:
            raise ValueError(f"unknown model size {arch!r}; choose one of {sorted(ARCHS)}")
        return arch


class FinetuneConfig(TrainingSection):
    """Per-task fine-tuning of a light head on the pretrained backbone (layer-wise lr decay)."""

    steps: int = Field(250, ge=1)
    seed: int = 0
    log_every: int = Field(10, ge=1)
    label_fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="share of the labelled train images fine-tuning uses (seeded subset)"
    )
    init_checkpoint: str | None = Field(
        None, description="a published Sapiens2 backbone to start from instead of our pretraining"
    )
    task_steps: dict[str, int] = Field(
        default_factory=dict, description="per-task step counts overriding `steps` (heatmap pose needs more)"
    )
    task_settings: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-task settings, e.g. {pose: {sigma: 3.0}} (task dataclass fields)"
    )
    augment: dict[str, Any] = Field(
        default_factory=dict,
        description="training augmentation (sapiens2.data.augment.Augment fields: affine_prob, max_rotation_deg, "
                    "photometric_prob, ...); empty = horizontal flip only",
    )
    deepspeed: DeepSpeedSection = DeepSpeedSection()
    optim: FinetuneOptimSection = FinetuneOptimSection(lr=5e-4, weight_decay=0.1, warmup_steps=25, layer_decay=0.8)
    task_optim: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-task overrides of `optim` fields, e.g. {pose: {backbone_frozen_fraction: 0.2}}"
    )
    checkpoint: CheckpointSection = CheckpointSection(every_n_steps=250, keep_last=1)

    @field_validator("augment")
    @classmethod
    def _valid_augment(cls, augment: dict[str, Any]) -> dict[str, Any]:
        if augment:
            cls._build_augment(augment)
        return augment

    @staticmethod
    def _build_augment(augment: dict[str, Any]):
        from sapiens2.data.augment import Augment  # torch-free but cv2-heavy: only when configured

        unknown = sorted(set(augment) - {"hflip_prob", "affine_prob", "scale_range", "max_rotation_deg",
                                         "photometric_prob", "brightness", "contrast", "saturation", "hue_deg"})
        if unknown:
            raise ValueError(f"unknown augmentation setting(s) {unknown}")
        settings = {k: tuple(v) if isinstance(v, list) else v for k, v in augment.items()}
        return Augment(**settings)

    def augmentation(self, flip_pairs: tuple[tuple[int, int], ...] | None = None):
        """The training recipe (`Augment`, flipping keypoints with `flip_pairs`), or None for the
        dataset's flip-only default."""
        if not self.augment:
            return None
        recipe = self._build_augment(self.augment)
        return recipe if flip_pairs is None else dataclasses.replace(recipe, flip_pairs=tuple(flip_pairs))

    @field_validator("task_settings")
    @classmethod
    def _valid_settings(cls, task_settings: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        from sapiens2.tasks import get_task  # torch-heavy: only when settings are given

        for name, settings in task_settings.items():
            get_task(name, **settings)  # unknown task, unknown field or bad value raise here
        return task_settings

    @field_validator("task_steps")
    @classmethod
    def _known_tasks(cls, task_steps: dict[str, int]) -> dict[str, int]:
        check_task_names(task_steps)
        if any(steps < 1 for steps in task_steps.values()):
            raise ValueError(f"step counts must be >= 1, got {task_steps}")
        return task_steps

    def steps_for(self, task: str) -> int:
        return self.task_steps.get(task, self.steps)

    @model_validator(mode="after")
    def _valid_task_optim(self):
        check_task_names(self.task_optim)
        for task in self.task_optim:
            try:
                optim = self.optim_for(task)
            except ValidationError as err:
                raise ValueError("; ".join(f"task_optim.{task}.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                           for e in err.errors())) from None
            if optim.warmup_steps > self.steps_for(task):
                raise ValueError(f"task_optim.{task}: warmup_steps ({optim.warmup_steps}) exceeds steps "
                                 f"({self.steps_for(task)})")
        return self

    def optim_for(self, task: str) -> FinetuneOptimSection:
        """`optim` with the task's `task_optim` overrides applied."""
        overrides = self.task_optim.get(task)
        if not overrides:
            return self.optim
        return FinetuneOptimSection.model_validate({**self.optim.model_dump(), **overrides})
