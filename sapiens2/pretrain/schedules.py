"""Per-step schedules of the distillation objective, as arrays indexed by optimizer step.

Every length is a fraction of the run (``ObjectiveConfig``), resolved to steps here and nowhere
else.
"""

from __future__ import annotations

import numpy as np

from sapiens2.pretrain.config import ObjectiveConfig
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
