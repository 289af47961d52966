"""Web-pool distractors: the junk a scraped pool contains besides clean person photos."""

from __future__ import annotations

import cv2
import numpy as np

from sapiens2.data.synth import textures
from sapiens2.data.synth.primitives import Capsule, Ellipsoid, Shape
from sapiens2.data.synth.render import cast, lambert
from sapiens2.data.synth.sample_io import encode_image

_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"))


def _random_objects(rng: np.random.Generator, count: int) -> list[Shape]:
    """Blobs and rods scattered in front of the camera, in camera space (no human layout)."""
    shapes: list[Shape] = []
    for _ in range(count):
        centre = np.array([rng.uniform(-0.8, 0.8), rng.uniform(-1.0, 1.0), rng.uniform(3.0, 6.0)])
        q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
        if rng.random() < 0.6:
            shapes.append(Ellipsoid("object", 0, len(shapes), centre, q, axes=rng.uniform(0.08, 0.5, 3)))
        else:
            end = centre + rng.normal(0, 0.4, 3)
            shapes.append(Capsule("object", 0, len(shapes), centre, q, end=end,
                                  radius=float(rng.uniform(0.05, 0.25))))
    return shapes


def no_person(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A textured backdrop with zero to four lit non-human objects."""
    image = textures.background(rng, height, width).astype(np.float64)
    shapes = _random_objects(rng, int(rng.integers(0, 5)))
    if shapes:
        focal = rng.uniform(1.0, 2.0) * height
        K = np.array([[focal, 0, width / 2], [0, focal, height / 2], [0, 0, 1]])
        hits = cast(shapes, K, height, width)
        mats = [textures.fabric(rng) for _ in shapes]
        light = np.array([rng.uniform(-0.8, 0.8), -rng.uniform(0.2, 1.0), -rng.uniform(0.2, 1.0)])
        light /= np.linalg.norm(light)
        for k in np.unique(hits.index[hits.mask]):
            sel = hits.index == k
            albedo = mats[k].albedo(hits.points[sel])
            image[sel] = lambert(albedo, hits.normal[sel], light, 0.4, np.ones(3))
    return np.round(np.clip(image, 0, 1) * 255).astype(np.uint8)


def _word(rng: np.random.Generator) -> str:
    return "".join(rng.choice(_LETTERS, size=int(rng.integers(2, 8))))


def text_overlay(rng: np.random.Generator, image: np.ndarray) -> np.ndarray:
    """Several lines of outlined text (captions, watermarks) spread over the image."""
    out = image.copy()
    height, width = image.shape[:2]
    n_lines = int(rng.integers(3, 7))
    scale = height / 128 * rng.uniform(0.35, 0.5)
    font = int(rng.choice([cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_PLAIN]))
    if font == cv2.FONT_HERSHEY_PLAIN:
        scale *= 1.6
    fill = tuple(int(c) for c in rng.choice([[255, 255, 255], [255, 230, 0], [20, 20, 20], [255, 40, 40]]))
    outline = (0, 0, 0) if sum(fill) > 300 else (255, 255, 255)
    thickness = max(1, round(height / 128))
    ys = np.linspace(0.12, 0.95, n_lines) * height + rng.uniform(-3, 3, n_lines)
    for y in ys:
        line = " ".join(_word(rng) for _ in range(int(rng.integers(2, 5))))
        x = int(rng.uniform(0, 0.15) * width)
        org = (x, int(y))
        cv2.putText(out, line, org, font, scale, outline, thickness + 2, cv2.LINE_AA)
        cv2.putText(out, line, org, font, scale, fill, thickness, cv2.LINE_AA)
    return out


def blurred(rng: np.random.Generator, image: np.ndarray) -> np.ndarray:
    """Strong Gaussian blur (a badly out-of-focus photo)."""
    sigma = rng.uniform(2.5, 4.0) * image.shape[0] / 128
    return cv2.GaussianBlur(image, (0, 0), sigmaX=sigma)


def near_duplicate(rng: np.random.Generator, image: np.ndarray) -> np.ndarray:
    """A slightly cropped and/or resized copy (same photo, different web rendition)."""
    height, width = image.shape[:2]
    mode = rng.integers(3)  # 0: crop, 1: resize, 2: both
    out = image
    if mode != 1:
        top, bottom = (rng.uniform(0.0, 0.06, 2) * height).astype(int)
        left, right = (rng.uniform(0.0, 0.06, 2) * width).astype(int)
        out = out[top:height - bottom, left:width - right]
    if mode != 0:
        factor = rng.uniform(0.75, 1.3)
        size = (max(1, round(out.shape[1] * factor)), max(1, round(out.shape[0] * factor)))
        out = cv2.resize(out, size, interpolation=cv2.INTER_AREA if factor < 1 else cv2.INTER_LINEAR)
    return np.ascontiguousarray(out)


def corrupt(rng: np.random.Generator, image: np.ndarray) -> bytes:
    """Undecodable bytes saved as .jpg: a truncated JPEG, an empty file or a text/HTML page."""
    kind = rng.integers(3)
    if kind == 0:
        data = encode_image(image, ".jpg", int(rng.integers(80, 96)))
        return data[: int(len(data) * rng.uniform(0.1, 0.5))]
    if kind == 1:
        return b""
    page = rng.choice(["<html><head><title>404 Not Found</title></head><body>Not Found</body></html>",
                       "Access denied. You do not have permission to view this resource.",
                       "{\"error\": \"rate limited\", \"retry_after\": 60}"])
    return str(page).encode()
