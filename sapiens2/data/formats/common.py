"""Pieces every format reader and writer shares: file access whose errors name the file and
field, the label check CuratedDataset applies, and labels derived from others (bbox from mask).

Readers yield samples in CuratedDataset's layout: "id", "image" (H, W, 3) uint8 RGB and any of
"keypoints" (K, 3) float32 x, y, visibility with pixel centres at column + 0.5, "seg" (H, W)
uint8, "mask" (H, W) bool, "normal" / "pointmap" (H, W, 3) float32 (camera space, metres),
"albedo" (H, W, 3) uint8, "K" (3, 3) float32 in the same pixel convention, "bbox" (4,) float32
x0, y0, x1, y1. A format that cannot hold a field leaves it out.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from sapiens2.data import decode
from sapiens2.data.augment import mask_bbox  # noqa: F401 (re-exported for the readers)
from sapiens2.data.dataset import validate_labels

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ValueError(f"{path}: missing {what} file")
    return path


def read_rgb(path: Path) -> np.ndarray:
    """An image file as (H, W, 3) uint8 RGB, through the platform's one decoder; a missing file
    is named as a missing image."""
    return decode.read_rgb(require(path, "image"))


def write_png(path: Path, image: np.ndarray) -> None:
    """Write (H, W) gray or (H, W, 3) RGB uint8 losslessly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = image[..., ::-1] if image.ndim == 3 else image
    if not cv2.imwrite(str(path), np.ascontiguousarray(pixels)):
        raise ValueError(f"{path}: could not write PNG")


def images_by_stem(folder: Path) -> dict[str, Path]:
    """Image files of `folder` keyed by file stem (ids must be unique)."""
    if not folder.is_dir():
        raise ValueError(f"{folder}: missing image folder")
    out: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() in IMAGE_SUFFIXES:
            if path.stem in out:
                raise ValueError(f"{folder}: two images with id {path.stem!r}")
            out[path.stem] = path
    return out


def check_sample(
    sample: dict[str, Any], path: Path | str, num_keypoints: int, num_classes: int
) -> None:
    """CuratedDataset's label check (shapes against the image, keypoint count, class range)."""
    labels = {k: v for k, v in sample.items() if k not in ("id", "image")}
    height, width = sample["image"].shape[:2]
    validate_labels(labels, height, width, num_keypoints, num_classes, str(path))


def unique_ids(samples: Iterable[dict[str, Any]]) -> Iterable[dict[str, Any]]:
    """Pass samples through, failing on a repeated id (writers name files by id)."""
    seen: set[str] = set()
    for sample in samples:
        if sample["id"] in seen:
            raise ValueError(f"sample id {sample['id']!r} appears twice")
        seen.add(sample["id"])
        yield sample
