"""The one image decoder: any file (or its bytes) into upright uint8 RGB, or why it cannot be used.

Curation judges images through `decode_image`; training, evaluation, prediction and the dataset
readers load them through `read_rgb`, the same decode, so a model sees what curation judged (an
EXIF-rotated JPEG upright, a 16-bit PNG scaled, a transparent PNG on white).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError


@dataclass(frozen=True)
class Decoded:
    """Result of decoding one file: exactly one of ``image`` and ``error`` is set.

    ``size`` is the upright (width, height) the file declares, which a draft-mode decode may
    have shrunk ``image`` below; None when the header could not be read.
    """

    image: np.ndarray | None
    error: str | None
    size: tuple[int, int] | None = None

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


def _draft(img: Image.Image, min_short_side: int) -> None:
    """Ask the JPEG decoder for a 1/2, 1/4 or 1/8 scale whose short side is still >= ``min_short_side``.

    Pillow's draft mode skips the discarded DCT coefficients, so a 1024-px photo that filters only
    look at 256 px of is decoded in a fraction of the time. Other formats ignore the request.
    """
    width, height = img.size
    factor = min_short_side / min(width, height)
    if factor < 0.5:  # the coarsest reduction the decoder has is 1/2
        img.draft(None, (math.ceil(width * factor), math.ceil(height * factor)))


def decode_image(source: str | Path | bytes, max_pixels: int, min_short_side: int | None = None) -> Decoded:
    """Read a file path (or its bytes) with Pillow, apply the EXIF orientation, convert to RGB (``to_rgb``).

    ``min_short_side`` allows a reduced JPEG decode (``_draft``) whose short side is at least
    that many pixels; None decodes at full resolution.

    Any failure (empty file, unknown format, truncated data, too many pixels) returns an
    ``error`` of the form ``"unreadable: <message>"`` instead of raising, so one bad file
    quarantines itself without stopping the run.
    """
    size = None
    try:
        # Pillow reports decompression bombs as warnings below 2x its own limit; make them errors.
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
                width, height = img.size
                if width * height > max_pixels:
                    return Decoded(None, f"unreadable: {width}x{height} exceeds max_pixels={max_pixels}")
                # EXIF orientations 5-8 turn the picture a quarter: width and height swap.
                size = (height, width) if img.getexif().get(0x0112, 1) in (5, 6, 7, 8) else (width, height)
                if min_short_side is not None:
                    _draft(img, min_short_side)
                # load() forces the full decode; a truncated JPEG fails here rather than later.
                img.load()
                rgb = to_rgb(ImageOps.exif_transpose(img))
    except UnidentifiedImageError:
        # Pillow's own message names the in-memory buffer's address, which differs on every run.
        return Decoded(None, "unreadable: not an image format Pillow can identify", size)
    except Exception as exc:  # noqa: BLE001 - every decoder failure means the same verdict
        message = str(exc).strip() or type(exc).__name__
        return Decoded(None, f"unreadable: {message}", size)
    if rgb.ndim != 3 or rgb.shape[0] == 0 or rgb.shape[1] == 0:
        return Decoded(None, f"unreadable: decoded to empty array of shape {rgb.shape}", size)
    return Decoded(np.ascontiguousarray(rgb), None, size)


# Training reads curated images, which curation already held to its own `max_pixels`; this
# bound only stops a decompression bomb in a dataset that skipped curation.
READ_MAX_PIXELS = 1 << 28


def read_rgb(source: str | Path | bytes, max_pixels: int = READ_MAX_PIXELS) -> np.ndarray:
    """`decode_image` at full resolution; raises ValueError naming the file and the reason."""
    decoded = decode_image(source, max_pixels)
    if not decoded.ok:
        where = "image data" if isinstance(source, bytes) else str(source)
        raise ValueError(f"{where}: {decoded.error}")
    return decoded.image
