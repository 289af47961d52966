"""Decode any image file into upright uint8 RGB, or say why it cannot be used."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


@dataclass(frozen=True)
class Decoded:
    """Result of decoding one file: exactly one of ``image`` and ``error`` is set."""

    image: np.ndarray | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.image is not None


def decode_image(path: str | Path, max_pixels: int) -> Decoded:
    """Read ``path`` with Pillow, apply the EXIF orientation and convert to RGB.

    Any failure (empty file, unknown format, truncated data, too many pixels) returns an
    ``error`` of the form ``"unreadable: <message>"`` instead of raising, so one bad file
    quarantines itself without stopping the run.
    """
    try:
        # Pillow reports decompression bombs as warnings below 2x its own limit; make them errors.
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                width, height = img.size
                if width * height > max_pixels:
                    return Decoded(None, f"unreadable: {width}x{height} exceeds max_pixels={max_pixels}")
                # load() forces the full decode; a truncated JPEG fails here rather than later.
                img.load()
                upright = ImageOps.exif_transpose(img)
                rgb = np.asarray(upright.convert("RGB"), dtype=np.uint8)
    except Exception as exc:  # noqa: BLE001 - every decoder failure means the same verdict
        message = str(exc).strip() or type(exc).__name__
        return Decoded(None, f"unreadable: {message}")
    if rgb.ndim != 3 or rgb.shape[0] == 0 or rgb.shape[1] == 0:
        return Decoded(None, f"unreadable: decoded to empty array of shape {rgb.shape}")
    return Decoded(np.ascontiguousarray(rgb), None)
