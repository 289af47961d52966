"""Per-step schedules as numpy arrays indexed by optimizer step (lr, EMA momentum, ...).

Arrays rather than stateful scheduler objects: the value at a step is a pure function of the
config, so resuming needs no scheduler state and the whole curve can be logged or plotted.
"""

from __future__ import annotations

import numpy as np

from sapiens2.train.config import OptimSection


def _check_lengths(total_steps: int, warmup_steps: int) -> None:
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must lie in [0, total_steps={total_steps}]")


def _cosine(start: float, end: float, n: int) -> np.ndarray:
    """n values on a half cosine from start (first) to end (last)."""
    if n == 1:
        return np.array([start], dtype=np.float64)
    t = np.arange(n, dtype=np.float64) / (n - 1)
    return end + 0.5 * (start - end) * (1.0 + np.cos(np.pi * t))


def _warmup(base: float, warmup_steps: int, start_factor: float) -> np.ndarray:
    # Ends one step short of base so the first post-warmup step is exactly base.
    return np.linspace(start_factor * base, base, warmup_steps, endpoint=False)


def warmup_linear_decay(
    base: float, total_steps: int, warmup_steps: int, min_ratio: float = 0.0, start_factor: float = 1e-3
) -> np.ndarray:
    """Linear warmup from start_factor*base to base, then linear decay to min_ratio*base at the
    last step (the Sapiens2 fine-tuning recipe: 1e-3x warmup, decay to 0)."""
    _check_lengths(total_steps, warmup_steps)
    decay = np.linspace(base, min_ratio * base, total_steps - warmup_steps)
    return np.concatenate([_warmup(base, warmup_steps, start_factor), decay])


def warmup_cosine(
    base: float, total_steps: int, warmup_steps: int, min_ratio: float = 0.0, start_factor: float = 1e-3
) -> np.ndarray:
    """Linear warmup from start_factor*base to base, then half-cosine decay to min_ratio*base."""
    _check_lengths(total_steps, warmup_steps)
    decay = _cosine(base, min_ratio * base, total_steps - warmup_steps)
    return np.concatenate([_warmup(base, warmup_steps, start_factor), decay])


def cosine_momentum(start: float, end: float, total_steps: int) -> np.ndarray:
    """EMA teacher momentum rising on a half cosine from start to end (DINO: 0.992 -> 1.0)."""
    _check_lengths(total_steps, 0)
    return _cosine(start, end, total_steps)


def lr_schedule(optim: OptimSection, total_steps: int) -> np.ndarray:
    """The base learning rate at every step, as the optimizer section prescribes."""
    shape = warmup_linear_decay if optim.schedule == "linear" else warmup_cosine
    return shape(optim.lr, total_steps, optim.warmup_steps, optim.min_lr_ratio)
