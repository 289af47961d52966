"""Random pinhole camera around the person, framed so the person fills most of the height."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_DEG = np.pi / 180.0


@dataclass(frozen=True)
class Camera:
    """OpenCV convention (x right, y down, z forward); `rotation` maps body to camera axes."""

    K: np.ndarray
    rotation: np.ndarray
    position: np.ndarray

    def to_camera(self, points: np.ndarray) -> np.ndarray:
        return (points - self.position) @ self.rotation.T

    def to_body(self, points: np.ndarray) -> np.ndarray:
        return points @ self.rotation + self.position


def _sample_yaw(rng: np.random.Generator) -> float:
    """Mostly frontal views, some side views and a few from behind."""
    r = rng.random()
    if r < 0.65:
        return rng.uniform(-35, 35) * _DEG
    if r < 0.9:
        return rng.choice((-1, 1)) * rng.uniform(35, 100) * _DEG
    return (180 + rng.uniform(-35, 35)) * _DEG


def look_at(position: np.ndarray, target: np.ndarray, roll: float) -> np.ndarray:
    forward = target - position
    forward /= np.linalg.norm(forward)
    right = np.cross(forward, [0.0, 1.0, 0.0])
    right /= np.linalg.norm(right)
    down = np.cross(forward, right)
    c, s = np.cos(roll), np.sin(roll)
    return np.stack([c * right + s * down, -s * right + c * down, forward])


def sample_camera(rng: np.random.Generator, extent: np.ndarray, height: int, width: int,
                  fill: tuple[float, float] = (0.6, 0.9)) -> Camera:
    """Place a camera around `extent` (body-frame surface samples) and pick K to frame it.

    Distance sets the perspective; the focal length then makes the person's projected height a
    `fill` share of the image (less when the width would not fit), and the principal point puts
    the person at a random spot inside the frame.
    """
    yaw, pitch = _sample_yaw(rng), rng.uniform(-8, 15) * _DEG
    lo, hi = extent.min(0), extent.max(0)
    target = (lo + hi) / 2 + rng.normal(0, 0.05, 3)
    distance = rng.uniform(2.5, 8.0)
    offset = np.array([np.sin(yaw) * np.cos(pitch), np.sin(pitch), np.cos(yaw) * np.cos(pitch)])
    position = target + distance * offset
    rotation = look_at(position, target, rng.normal(0, 2.5) * _DEG)
    cam = (extent - position) @ rotation.T
    x, y = cam[:, 0] / cam[:, 2], cam[:, 1] / cam[:, 2]
    focal = min(rng.uniform(*fill) * height / np.ptp(y), rng.uniform(0.8, 0.95) * width / np.ptp(x))
    cx = rng.uniform(0.15, 0.85) * (width - focal * np.ptp(x)) - focal * x.min()
    cy = rng.uniform(0.25, 0.75) * (height - focal * np.ptp(y)) - focal * y.min()
    K = np.array([[focal, 0, cx], [0, focal, cy], [0, 0, 1]])
    return Camera(K, rotation, position)
