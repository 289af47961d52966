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


def to_rgb(img: Image.Image) -> np.ndarray:
    """uint8 RGB pixels of any Pillow mode, scaled and composited so scores see what a viewer sees.

    Pillow's ``convert("RGB")`` clips 16-bit grey (mode I;16 / I) at 255 instead of scaling it,
    which turns most 16-bit PNGs white; and it drops alpha, exposing whatever colour transparent
    pixels store (often black). So 16-bit data is scaled by 1/257, and transparent images are
    composited over white, the backdrop a browser shows them on. CMYK and palette images go
    through Pillow's own conversions; animated files arrive here at their first frame.
    """
    if img.mode.startswith("I;16") or img.mode == "I":
        grey = np.asarray(img, dtype=np.float64)
        if img.mode.startswith("I;16") or grey.max() > 255:
            grey = grey / 257.0
        img = Image.fromarray(np.clip(np.rint(grey), 0, 255).astype(np.uint8))
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        img = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.asarray(img.convert("RGB"), dtype=np.uint8)


def decode_image(path: str | Path, max_pixels: int) -> Decoded:
    """Read ``path`` with Pillow, apply the EXIF orientation and convert to RGB (``to_rgb``).

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
                rgb = to_rgb(ImageOps.exif_transpose(img))
    except Exception as exc:  # noqa: BLE001 - every decoder failure means the same verdict
        message = str(exc).strip() or type(exc).__name__
        return Decoded(None, f"unreadable: {message}")
    if rgb.ndim != 3 or rgb.shape[0] == 0 or rgb.shape[1] == 0:
        return Decoded(None, f"unreadable: decoded to empty array of shape {rgb.shape}")
    return Decoded(np.ascontiguousarray(rgb), None)
