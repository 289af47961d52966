"""Angular error between normal maps, and its exact-merge accumulator.

Errors are binned in a fixed 0.01-degree histogram over [0, 180] next to exact sums, so the
mean, RMSE and within-threshold fractions are exact and the median is exact to the bin width,
whatever the batch split or number of ranks. Used by the normal task and by the pointmap task
for the normals derived from its pointmap.
"""

from __future__ import annotations

import numpy as np
import torch

from sapiens2.tasks.channels import channel_cross, channel_norm

BIN_WIDTH_DEG = 0.01
NUM_BINS = int(round(180 / BIN_WIDTH_DEG))
THRESHOLDS_DEG = (5.0, 11.25, 22.5, 30.0)


def angular_error_deg(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Angle in degrees between (B, 3, H, W) vector fields, per pixel -> (B, H, W).

    atan2(|a x b|, a . b) is used instead of acos(a . b) because it stays accurate for small
    angles and does not need unit inputs.
    """
    cross = channel_norm(channel_cross(pred, target))
    dot = (pred * target).sum(dim=1)
    return torch.rad2deg(torch.atan2(cross, dot))


def empty_angular_state() -> dict[str, np.ndarray]:
    return {
        "histogram": np.zeros(NUM_BINS, dtype=np.int64),
        "within": np.zeros(len(THRESHOLDS_DEG), dtype=np.int64),
        "sum": np.zeros((), dtype=np.float64),
        "sum_sq": np.zeros((), dtype=np.float64),
        "count": np.zeros((), dtype=np.int64),
    }


def accumulate_angular(
    state: dict[str, np.ndarray], errors_deg: torch.Tensor, prefix: str = ""
) -> None:
    """Add a 1-D tensor of errors to the `prefix`-named entries of a metric state."""
    errors = errors_deg.detach().double().cpu().reshape(-1)
    bins = (errors / BIN_WIDTH_DEG).floor().long().clamp(0, NUM_BINS - 1)
    state[prefix + "histogram"] += torch.bincount(bins, minlength=NUM_BINS).numpy()
    state[prefix + "within"] += np.array(
        [(errors < t).sum().item() for t in THRESHOLDS_DEG], np.int64
    )
    state[prefix + "sum"] += errors.sum().item()
    state[prefix + "sum_sq"] += errors.pow(2).sum().item()
    state[prefix + "count"] += errors.numel()


def summarize_angular(
    state: dict[str, np.ndarray], name: str, prefix: str = ""
) -> dict[str, float]:
    """`<name>_mean/_median/_rmse` in degrees and `<name>_within_<t>deg` fractions in [0, 1].

    The median is the lower median (the ceil(n/2)-th smallest error), reported at the centre of
    its 0.01-degree bin.
    """
    count = int(state[prefix + "count"])
    if count == 0:
        raise ValueError(f"no pixels accumulated for {name}")
    cumulative = np.cumsum(state[prefix + "histogram"])
    median_bin = int(np.searchsorted(cumulative, (count + 1) // 2))
    out = {
        f"{name}_mean": float(state[prefix + "sum"]) / count,
        f"{name}_median": (median_bin + 0.5) * BIN_WIDTH_DEG,
        f"{name}_rmse": float(np.sqrt(state[prefix + "sum_sq"] / count)),
    }
    for t, n in zip(THRESHOLDS_DEG, state[prefix + "within"], strict=True):
        out[f"{name}_within_{t:g}deg"] = int(n) / count
    return out
