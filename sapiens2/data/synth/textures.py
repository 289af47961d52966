"""Procedural colours and textures: solid textures for body materials, 2D backgrounds."""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

PATTERNS = ("plain", "stripes", "checks", "noise")


@dataclass(frozen=True)
class Material:
    """A solid texture: `base` and `accent` colours (linear RGB in [0, 1]) mixed by a pattern.

    The pattern is evaluated at 3D points of the body frame, so it sticks to the surface and
    needs no UV mapping. `period` is in metres; `grain` is a fine multiplicative variation.
    """

    base: np.ndarray
    accent: np.ndarray
    pattern: str
    period: float
    direction: np.ndarray
    waves: np.ndarray  # (4, 4): unit wave directions and phases for the noise and grain
    grain: float

    def albedo(self, points: np.ndarray) -> np.ndarray:
        phase = 2 * np.pi / self.period
        if self.pattern == "stripes":
            mix = (np.sin(phase * points @ self.direction) > 0).astype(np.float64)
        elif self.pattern == "checks":
            s = np.sin(phase * points)
            mix = (s[:, 0] * s[:, 1] * s[:, 2] > 0).astype(np.float64)
        elif self.pattern == "noise":
            mix = 0.5 + 0.125 * np.sin(phase * points @ self.waves[:, :3].T + self.waves[:, 3]).sum(1)
        else:
            mix = np.zeros(len(points))
        fine = 1.0 + self.grain * np.sin(phase * 7.3 * points @ self.waves[:, :3].T
                                         + self.waves[:, 3]).mean(1)
        colour = self.base[None, :] * (1 - mix[:, None]) + self.accent[None, :] * mix[:, None]
        return np.clip(colour * fine[:, None], 0.0, 1.0)


def _waves(rng: np.random.Generator) -> np.ndarray:
    dirs = rng.normal(size=(4, 3))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    return np.concatenate([dirs, rng.uniform(0, 2 * np.pi, (4, 1))], axis=1)


def hsv_colour(rng: np.random.Generator, sat=(0.0, 0.85), val=(0.12, 0.95)) -> np.ndarray:
    hsv = np.array([[[rng.uniform(0, 180), rng.uniform(*sat) * 255, rng.uniform(*val) * 255]]])
    return cv2.cvtColor(hsv.astype(np.uint8), cv2.COLOR_HSV2RGB)[0, 0].astype(np.float64) / 255


def fabric(rng: np.random.Generator, plain_prob: float = 0.5) -> Material:
    """Clothing: a random colour, plain or with stripes, checks or a mottled print."""
    base = hsv_colour(rng)
    pattern = "plain" if rng.random() < plain_prob else str(rng.choice(PATTERNS[1:]))
    accent = np.clip(base * rng.uniform(0.4, 0.8), 0, 1) if rng.random() < 0.5 else hsv_colour(rng)
    direction = np.array([rng.normal(0, 0.3), 1.0, rng.normal(0, 0.3)])
    if rng.random() < 0.3:
        direction = np.array([1.0, rng.normal(0, 0.2), 0.0])
    return Material(base, accent, pattern, float(rng.uniform(0.04, 0.14)),
                    direction / np.linalg.norm(direction), _waves(rng), float(rng.uniform(0.02, 0.08)))


def skin(rng: np.random.Generator) -> Material:
    """Skin tone drawn along a light-to-dark axis with a small random tint."""
    t = rng.random()
    light, dark = np.array([0.96, 0.80, 0.69]), np.array([0.30, 0.19, 0.13])
    base = np.clip(light * (1 - t) + dark * t + rng.normal(0, 0.02, 3), 0, 1)
    return Material(base, base * 0.85, "noise", 0.08, np.array([0.0, 1.0, 0.0]), _waves(rng), 0.02)


_HAIR = np.array([[0.04, 0.03, 0.03], [0.16, 0.10, 0.06], [0.33, 0.21, 0.12],
                  [0.72, 0.58, 0.34], [0.60, 0.58, 0.56], [0.50, 0.20, 0.08]])


def hair(rng: np.random.Generator) -> Material:
    """Natural hair colour with fine strands running down the head."""
    base = np.clip(_HAIR[rng.choice(len(_HAIR), p=[0.35, 0.25, 0.18, 0.1, 0.07, 0.05])]
                   * rng.uniform(0.85, 1.15), 0, 1)
    return Material(base, base * 0.6, "stripes", 0.012, np.array([1.0, 0.0, 0.0]), _waves(rng), 0.1)


def flat(colour) -> Material:
    """Uniform material for small features (eyes, lips, teeth)."""
    c = np.asarray(colour, np.float64)
    return Material(c, c, "plain", 1.0, np.array([0.0, 1.0, 0.0]), np.zeros((4, 4)), 0.0)


def _smooth_noise(rng: np.random.Generator, height: int, width: int, cells: int) -> np.ndarray:
    grid = rng.random((cells + 1, max(2, cells * width // height) + 1)).astype(np.float32)
    return cv2.resize(grid, (width, height), interpolation=cv2.INTER_CUBIC)


def background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Textured backdrop (gradient, stripes, mottled noise, tiles or a wall-and-floor room).

    Returns float32 (H, W, 3) in [0, 1].
    """
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    yy, xx = yy / height, xx / height
    c1, c2 = hsv_colour(rng, val=(0.2, 0.95)), hsv_colour(rng, val=(0.2, 0.95))
    kind = rng.integers(5)
    if kind == 0:
        angle = rng.uniform(0, np.pi)
        mix = np.clip(0.5 + (np.cos(angle) * (xx - 0.4) + np.sin(angle) * (yy - 0.5)), 0, 1)
    elif kind == 1:
        angle, period = rng.uniform(0, np.pi), rng.uniform(0.04, 0.3)
        wave = np.sin(2 * np.pi * (np.cos(angle) * xx + np.sin(angle) * yy) / period)
        mix = 0.5 + 0.5 * np.tanh(wave * rng.uniform(1, 8))
    elif kind == 2:
        mix = sum(_smooth_noise(rng, height, width, c) * w for c, w in ((3, 0.6), (9, 0.3), (24, 0.1)))
    elif kind == 3:
        period = rng.uniform(0.05, 0.2)
        mix = ((np.floor(xx / period) + np.floor(yy / period)) % 2) * rng.uniform(0.3, 1.0)
    else:
        horizon = rng.uniform(0.45, 0.8)
        mix = (yy > horizon) * np.clip((yy - horizon) * 2 + 0.5, 0, 1)
    img = c1[None, None, :] * (1 - mix[..., None]) + c2[None, None, :] * mix[..., None]
    img *= 1 + 0.15 * (_smooth_noise(rng, height, width, 5)[..., None] - 0.5)
    return np.clip(img, 0, 1).astype(np.float32)
