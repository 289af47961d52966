"""Analytic ray-traceable shapes: oriented ellipsoids and capsules, vectorised over rays.

Rays start at the camera origin with directions d = ((u - cx)/fx, (v - cy)/fy, 1), so the ray
parameter t of a hit equals its camera-space depth Z and the hit point t * d reprojects exactly
onto the pixel the ray was cast through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

_INF = np.inf
# 26 directions (cube corners, edge midpoints, face centres) used to sample a shape's extent.
_DIRS = np.array([(x, y, z) for x in (-1, 0, 1) for y in (-1, 0, 1) for z in (-1, 0, 1)
                  if (x, y, z) != (0, 0, 0)], dtype=np.float64)
_DIRS /= np.linalg.norm(_DIRS, axis=1, keepdims=True)


@dataclass(frozen=True)
class Region:
    """Axis-aligned box in a shape's local coordinates whose surface gets another class/material.

    Local coordinates: unit-sphere coordinates for ellipsoids; for capsules (x, z, s) with x, z the
    radial direction in the capsule frame and s in [0, 1] along the axis from start to end.
    """

    seg_class: int
    material: int
    lo: tuple[float, float, float] = (-_INF, -_INF, -_INF)
    hi: tuple[float, float, float] = (_INF, _INF, _INF)


def band(seg_class: int, material: int, s0: float, s1: float) -> Region:
    """Capsule region between axis fractions s0 and s1 (a sleeve, a trouser leg, a sock)."""
    return Region(seg_class, material, (-_INF, -_INF, s0), (_INF, _INF, s1))


def _in_box(local: np.ndarray, lo, hi) -> np.ndarray:
    inside = (local >= lo) & (local <= hi)
    return inside[:, 0] & inside[:, 1] & inside[:, 2]


def _unit_rows(v: np.ndarray) -> np.ndarray:
    return v / np.sqrt(np.einsum("ij,ij->i", v, v))[:, None]


def _first_root(a, b, c) -> np.ndarray:
    """Smaller root of a t^2 + 2 b t + c = 0 (a > 0), inf where there is none or it lies behind
    the camera."""
    disc = b * b - a * c
    t = (-b - np.sqrt(np.maximum(disc, 0.0))) / a
    return np.where((disc >= 0.0) & (t > 1e-6), t, _INF)


@dataclass(frozen=True)
class Shape:
    """Common fields: a name (used for keypoint ownership), class, material and local frame."""

    name: str
    seg_class: int
    material: int
    centre: np.ndarray  # ellipsoid centre, or capsule start point
    frame: np.ndarray  # (3, 3) columns are the local axes
    regions: tuple[Region, ...] = ()

    def moved(self, rot: np.ndarray, shift: np.ndarray) -> "Shape":
        """The same shape after the rigid map p -> rot @ p + shift."""
        return replace(self, centre=rot @ self.centre + shift, frame=rot @ self.frame)

    def _bounding_sphere(self) -> tuple[np.ndarray, float]:
        raise NotImplementedError

    def screen_box(self, K: np.ndarray, height: int, width: int) -> tuple[int, int, int, int] | None:
        """Conservative pixel rectangle (r0, r1, c0, c1) covering the projected shape, or None."""
        c, rad = self._bounding_sphere()
        x, y, z = (float(v) for v in c)
        if z + rad <= 1e-3:
            return None
        if z - rad <= 1e-3:
            return 0, height, 0, width
        near, far = 1.0 / (z - rad), 1.0 / (z + rad)
        fx, fy, cx, cy = float(K[0, 0]), float(K[1, 1]), float(K[0, 2]), float(K[1, 2])
        u0 = fx * min((x - rad) * near, (x - rad) * far) + cx
        u1 = fx * max((x + rad) * near, (x + rad) * far) + cx
        v0 = fy * min((y - rad) * near, (y - rad) * far) + cy
        v1 = fy * max((y + rad) * near, (y + rad) * far) + cy
        c0, c1 = max(math.floor(u0) - 1, 0), min(math.ceil(u1) + 1, width)
        r0, r1 = max(math.floor(v0) - 1, 0), min(math.ceil(v1) + 1, height)
        if c0 >= c1 or r0 >= r1:
            return None
        return r0, r1, c0, c1

    def label(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-point (seg class, material) after applying the regions in order."""
        seg = np.full(len(local), self.seg_class, np.uint8)
        mat = np.full(len(local), self.material, np.int16)
        for reg in self.regions:
            inside = _in_box(local, reg.lo, reg.hi)
            seg[inside] = reg.seg_class
            mat[inside] = reg.material
        return seg, mat


@dataclass(frozen=True)
class Ellipsoid(Shape):
    """Ellipsoid with semi-axes `axes` along the frame columns; `cutout` removes a local box.

    The cutout makes open shells (a hair cap open at the face, a hat open below): rays whose first
    hit falls inside the cutout pass through and find whatever lies beneath.
    """

    axes: np.ndarray = field(kw_only=True)
    cutout: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None

    def _bounding_sphere(self):
        return self.centre, float(np.max(self.axes))

    def _to_local(self, dirs: np.ndarray):
        scale = self.frame / self.axes[None, :]  # columns scaled: local = frame^T p / axes
        o = -(self.centre @ scale)
        return o, dirs @ scale

    def extent_points(self) -> np.ndarray:
        """Surface points in 26 directions: enough to frame the shape with a camera."""
        return self.centre + (_DIRS * self.axes) @ self.frame.T

    def intersect(self, dirs: np.ndarray) -> np.ndarray:
        o, d = self._to_local(dirs)
        a = np.einsum("ij,ij->i", d, d)
        b = d @ o
        t = _first_root(a, b, o @ o - 1.0)
        if self.cutout is not None:
            hit = np.isfinite(t)
            local = o[None, :] + t[hit, None] * d[hit]
            cut = np.zeros_like(hit)
            cut[hit] = _in_box(local, *self.cutout)
            t[cut] = _INF
        return t

    def surface(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Unit outward normals and local unit-sphere coordinates of surface points."""
        local = ((points - self.centre) @ self.frame) / self.axes
        return _unit_rows((local / self.axes) @ self.frame.T), local


@dataclass(frozen=True)
class Capsule(Shape):
    """Segment from `centre` to `end` swept by a sphere of `radius` (a limb between two joints)."""

    end: np.ndarray = field(kw_only=True)
    radius: float = field(kw_only=True)

    def moved(self, rot, shift):
        return replace(super().moved(rot, shift), end=rot @ self.end + shift)

    def _bounding_sphere(self):
        mid = 0.5 * (self.centre + self.end)
        return mid, float(np.linalg.norm(self.end - self.centre) / 2 + self.radius)

    def extent_points(self) -> np.ndarray:
        return np.concatenate([self.centre + self.radius * _DIRS, self.end + self.radius * _DIRS])

    def intersect(self, dirs: np.ndarray) -> np.ndarray:
        a_pt, b_pt, r = self.centre, self.end, self.radius
        ba = b_pt - a_pt
        baba, baoa = ba @ ba, -(ba @ a_pt)
        rdrd = np.einsum("ij,ij->i", dirs, dirs)
        bard, rda, rdb = (dirs @ np.array([ba, a_pt, b_pt]).T).T
        # Infinite cylinder, accepted where the hit projects inside the segment; rays almost
        # parallel to the axis are left to the end spheres.
        qa = np.maximum(baba * rdrd - bard * bard, 1e-12)
        t_cyl = _first_root(qa, -baba * rda - baoa * bard,
                            baba * (a_pt @ a_pt) - baoa * baoa - r * r * baba)
        y = baoa + np.where(np.isfinite(t_cyl), t_cyl, 0.0) * bard
        t_cyl[(y <= 0.0) | (y >= baba)] = _INF
        # The capsule's entry point is the nearest entry of its three convex pieces.
        t_a = _first_root(rdrd, -rda, a_pt @ a_pt - r * r)
        t_b = _first_root(rdrd, -rdb, b_pt @ b_pt - r * r)
        return np.minimum(np.minimum(t_cyl, t_a), t_b)

    def surface(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Unit outward normals and local (x, z, s) coordinates of surface points."""
        ba = self.end - self.centre
        s = np.clip((points - self.centre) @ ba / (ba @ ba), 0.0, 1.0)
        normal = _unit_rows(points - (self.centre[None, :] + s[:, None] * ba[None, :]))
        local = normal @ self.frame
        local[:, 1] = local[:, 2]
        local[:, 2] = s
        return normal, local
