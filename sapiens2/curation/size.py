"""Image size scorer: the short side gates the resolution filter."""

from __future__ import annotations

import numpy as np


class SizeScorer:
    """Scores width, height and short side (after EXIF rotation) of a decoded image."""

    def __call__(self, image: np.ndarray) -> dict[str, float]:
        height, width = image.shape[:2]
        return {"width": float(width), "height": float(height), "short_side": float(min(height, width))}
