"""Pretraining objective: L = L_MAE + lambda * L_CL (masked autoencoding + CLS self-distillation).

Data side: ``MultiCropAugment`` (global/local crops) and ``MaskGenerator`` (MAE masks). Model side:
``PretrainStudent`` (backbone + MAE decoder + DINO head) and the teacher phases ``build_teacher``,
``teacher_output``, ``ema_update`` with ``TeacherCenter``. Schedules are arrays indexed by step.
"""

from sapiens2.pretrain.augment import MultiCropAugment
from sapiens2.pretrain.config import ObjectiveConfig
from sapiens2.pretrain.dino import DINOHead, TeacherCenter
from sapiens2.pretrain.mae import MAEDecoder
from sapiens2.pretrain.masking import MaskGenerator, mask_to_indices
from sapiens2.pretrain.meta_arch import (
    PretrainStudent,
    TeacherModel,
    build_teacher,
    ema_update,
    teacher_output,
)
from sapiens2.pretrain.schedules import (
    ema_momentum_schedule,
    objective_schedules,
    teacher_temp_schedule,
)

__all__ = [
    "DINOHead",
    "MAEDecoder",
    "MaskGenerator",
    "MultiCropAugment",
    "ObjectiveConfig",
    "PretrainStudent",
    "TeacherCenter",
    "TeacherModel",
    "build_teacher",
    "ema_momentum_schedule",
    "ema_update",
    "mask_to_indices",
    "objective_schedules",
    "teacher_output",
    "teacher_temp_schedule",
]
