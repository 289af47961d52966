"""Vectorised ray casting of analytic shapes and Lambertian shading.

One ray per pixel centre; each shape is intersected only with the rays inside its projected
bounding box, and the nearest hit wins (a z-buffer over shapes, no per-pixel Python loops).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sapiens2.data.synth.primitives import Shape


@dataclass(frozen=True)
class Hits:
    """Per-pixel results of casting one ray through each pixel centre; background is -1/0."""

    index: np.ndarray  # (H, W) shape index or -1
    depth: np.ndarray  # (H, W) camera-space Z, inf on background
    points: np.ndarray  # (H, W, 3) camera-space hit points
    normal: np.ndarray  # (H, W, 3) unit normals facing the camera
    seg: np.ndarray  # (H, W) uint8 class ids
    material: np.ndarray  # (H, W) material ids, -1 on background

    @property
    def mask(self) -> np.ndarray:
        return self.index >= 0


def pixel_rays(K: np.ndarray, height: int, width: int) -> np.ndarray:
    """(H, W, 3) directions through pixel centres (column + 0.5, row + 0.5), scaled to z = 1."""
    rays = np.ones((height, width, 3))
    rays[..., 0] = ((np.arange(width) + 0.5 - K[0, 2]) / K[0, 0])[None, :]
    rays[..., 1] = ((np.arange(height) + 0.5 - K[1, 2]) / K[1, 1])[:, None]
    return rays


def _nearest(shapes: Sequence[Shape], K: np.ndarray, rays: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Z-buffer over shapes: (shape index or -1, depth or inf) per pixel."""
    height, width = rays.shape[:2]
    depth = np.full((height, width), np.inf)
    index = np.full((height, width), -1, np.int32)
    for k, shape in enumerate(shapes):
        box = shape.screen_box(K, height, width)
        if box is None:
            continue
        r0, r1, c0, c1 = box
        t = shape.intersect(rays[r0:r1, c0:c1].reshape(-1, 3)).reshape(r1 - r0, c1 - c0)
        sub_depth, sub_index = depth[r0:r1, c0:c1], index[r0:r1, c0:c1]  # views
        closer = t < sub_depth
        sub_depth[closer] = t[closer]
        sub_index[closer] = k
    return index, depth


def cast(shapes: Sequence[Shape], K: np.ndarray, height: int, width: int) -> Hits:
    """Render camera-space shapes: nearest hit per pixel centre and its surface attributes."""
    rays = pixel_rays(K, height, width)
    index, depth = _nearest(shapes, K, rays)
    points, normal = np.zeros((height, width, 3)), np.zeros((height, width, 3))
    seg, material = np.zeros((height, width), np.uint8), np.full((height, width), -1, np.int16)
    hit = np.flatnonzero(index >= 0)
    hit_index = index.ravel()[hit]
    hit_rays = rays.reshape(-1, 3)[hit]
    hit_points = hit_rays * depth.ravel()[hit, None]
    points.reshape(-1, 3)[hit] = hit_points
    # Group the hit pixels by shape so each shape evaluates its surface once.
    order = np.argsort(hit_index, kind="stable")
    bounds = np.searchsorted(hit_index[order], np.arange(len(shapes) + 1))
    for k, shape in enumerate(shapes):
        rows = order[bounds[k]:bounds[k + 1]]
        if len(rows) == 0:
            continue
        n, local = shape.surface(hit_points[rows])
        # First hits of convex pieces face the camera already; the flip guards grazing rays.
        n[np.einsum("ij,ij->i", n, hit_rays[rows]) > 0] *= -1
        pix = hit[rows]
        normal.reshape(-1, 3)[pix] = n
        seg.ravel()[pix], material.ravel()[pix] = shape.label(local)
    return Hits(index, depth, points, normal, seg, material)


def lambert(albedo: np.ndarray, normal: np.ndarray, light: np.ndarray, ambient: float,
            colour: np.ndarray) -> np.ndarray:
    """albedo * colour * (ambient + (1 - ambient) * max(0, n . l)) for a directional light."""
    diffuse = np.clip(normal @ light, 0.0, None)
    return albedo * colour * (ambient + (1.0 - ambient) * diffuse)[..., None]
