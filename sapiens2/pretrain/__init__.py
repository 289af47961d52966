"""Pretraining objective: masked autoencoding plus dense (patch) and sparse (CLS) self-distillation.

Data side: ``MultiCropAugment`` (global/local crops) and ``MaskGenerator`` (MAE masks). Model side:
``PretrainStudent`` (backbone + MAE decoder + CLS and patch heads) and the teacher phases
``build_teacher``, ``teacher_output`` (with ``Centering``), ``ema_update``. Schedules are arrays indexed by step.
"""

from sapiens2.pretrain.augment import MultiCropAugment
from sapiens2.pretrain.config import ObjectiveConfig
from sapiens2.pretrain.centering import Centering, TeacherCenter, sinkhorn_knopp
from sapiens2.pretrain.dino import DINOHead
from sapiens2.pretrain.mae import MAEDecoder
from sapiens2.pretrain.masking import MaskGenerator, mask_to_indices
from sapiens2.pretrain.meta_arch import PretrainStudent
from sapiens2.pretrain.teacher import TeacherModel, build_teacher, ema_update, teacher_output
from sapiens2.pretrain.schedules import (
    ema_momentum_schedule,
    objective_schedules,
    teacher_temp_schedule,
)

__all__ = [
    "Centering",
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
    "sinkhorn_knopp",
    "teacher_temp_schedule",
]
