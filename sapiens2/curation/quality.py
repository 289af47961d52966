"""Blur and exposure scores from the grey image."""

from __future__ import annotations

import cv2
import numpy as np

# Pixels this close to 0 or 255 carry no detail; a large share of them means blown or crushed exposure.
_CLIP_LOW, _CLIP_HIGH = 5, 250


def to_grey(image: np.ndarray, max_short_side: int) -> np.ndarray:
    """Grey version of an RGB image, area-downscaled so its short side is at most ``max_short_side``.

    Analysing every image at a bounded scale keeps the thresholds meaningful across resolutions
    (the Laplacian variance of the same photo falls as its pixel count grows).
    """
    grey = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    short = min(grey.shape)
    if short > max_short_side:
        factor = max_short_side / short
        size = (round(grey.shape[1] * factor), round(grey.shape[0] * factor))
        grey = cv2.resize(grey, size, interpolation=cv2.INTER_AREA)
    return grey


class QualityScorer:
    """Sharpness (variance of the Laplacian), mean brightness and clipped-pixel fraction."""

    def __init__(self, analysis_short_side: int = 256) -> None:
        self.analysis_short_side = analysis_short_side

    def __call__(self, image: np.ndarray) -> dict[str, float]:
        grey = to_grey(image, self.analysis_short_side)
        sharpness = float(cv2.Laplacian(grey, cv2.CV_64F).var())
        clipped = float(np.mean((grey <= _CLIP_LOW) | (grey >= _CLIP_HIGH)))
        return {"sharpness": sharpness, "brightness": float(grey.mean()), "clipped_fraction": clipped}
