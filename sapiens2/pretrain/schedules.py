"""Per-step schedules of the distillation objective, as arrays indexed by optimizer step, and the
pretraining optimizer groups whose prototypes those schedules freeze.

Every length is a fraction of the run (``ObjectiveConfig``), resolved to steps here and nowhere
else.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from sapiens2.pretrain.config import ObjectiveConfig
from sapiens2.pretrain.dino import PROTOTYPES
from sapiens2.train.config import OptimSection
from sapiens2.train.lr_decay import layerwise_param_groups
from sapiens2.train.schedules import cosine_momentum


def teacher_temp_schedule(
    start: float, end: float, warmup_steps: int, total_steps: int
) -> np.ndarray:
    """Linear ramp from ``start`` to ``end`` over ``warmup_steps``, then constant ``end``.

    A low initial teacher temperature sharpens targets early, which DINO found to stabilise the
    first steps; the warmup is clipped to the run length.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    warmup = min(warmup_steps, total_steps)
    ramp = np.linspace(start, end, warmup, endpoint=False)
    return np.concatenate([ramp, np.full(total_steps - warmup, end)])


def ema_momentum_schedule(start: float, end: float, total_steps: int) -> np.ndarray:
    """Cosine ramp of the teacher EMA momentum from ``start`` (step 0) to ``end`` (last step)."""
    return cosine_momentum(start, end, total_steps)


def ema_momentum_start(cfg: ObjectiveConfig, total_steps: int) -> float:
    """The first step's EMA momentum: time constant 1 / (1 - m) = the configured fraction of the
    run, capped at ``cfg.ema_momentum_start`` (DINO's value, reached by runs of a few thousand
    steps and more)."""
    time_constant = max(1.0, cfg.ema_time_constant_fraction * total_steps)
    return min(cfg.ema_momentum_start, 1.0 - 1.0 / time_constant)


def freeze_last_layer_steps(cfg: ObjectiveConfig, total_steps: int) -> int:
    """Steps during which the heads' prototype layers get no update (DINO's first epoch)."""
    return int(round(cfg.freeze_last_layer_fraction * total_steps))


def pretrain_param_groups(
    student: nn.Module, optim: OptimSection, cfg: ObjectiveConfig, total_steps: int
) -> list[dict]:
    """AdamW groups of a pretraining run: layer-wise lr decay over the student's backbone, and the
    heads' prototypes frozen for their first steps and never weight-decayed (they are used
    normalised: decay would only shrink their norm and so inflate their effective step)."""
    frozen = freeze_last_layer_steps(cfg, total_steps)
    return layerwise_param_groups(
        student, optim.lr, optim.weight_decay, optim.layer_decay, student.backbone.depth, student.backbone.layer_id,
        frozen_steps=lambda name: frozen if name.endswith(PROTOTYPES) else 0,
        no_weight_decay=lambda name: name.endswith(PROTOTYPES),
    )


def objective_schedules(cfg: ObjectiveConfig, total_steps: int) -> dict[str, np.ndarray]:
    """The objective's per-step arrays for a run: ``teacher_temp`` and ``ema_momentum``."""
    warmup = int(round(cfg.teacher_temp_warmup_fraction * total_steps))
    return {
        "teacher_temp": teacher_temp_schedule(
            cfg.teacher_temp_warmup_start, cfg.teacher_temp, warmup, total_steps
        ),
        "ema_momentum": ema_momentum_schedule(
            ema_momentum_start(cfg, total_steps), cfg.ema_momentum_end, total_steps
        ),
    }
