"""The one interface every per-image curation scorer implements."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np


class Scorer(Protocol):
    """Scores one decoded image: uint8 RGB array (H, W, 3) in, flat dict of named scores out.

    Scorers hold their thresholds' inputs but never decide keep/reject themselves; the filter
    chain compares scores to the config, so the manifest records the evidence for every verdict.
    """

    def __call__(self, image: np.ndarray) -> dict[str, float | str]: ...


def score_batch(scorer: Scorer, images: Iterable[np.ndarray]) -> list[dict[str, float | str]]:
    """Apply a scorer to a batch of images (a list or an (N, H, W, 3) array)."""
    return [scorer(image) for image in images]
