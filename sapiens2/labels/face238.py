"""The 238 face landmarks of the 308-keypoint set: names and a canonical frontal face template.

The reference names of the 238 face points are not in our facts, so the layout is ours:

- points 0-67 carry the semantics of the 68-point iBUG / COCO-WholeBody face, in that order
  (jaw 0-16 from the person's right ear to the left, brows 17-26, nose 27-35, eyes 36-47, outer
  lips 48-59, inner lips 60-67), so COCO-WholeBody face labels map onto them one to one and
  their OKS sigmas apply;
- points 68-237 densify the same contours (midpoints between neighbours, lower brow edge,
  iris) and add surface points of the face (forehead, temples, cheeks, under-eye,
  nasolabial folds, philtrum, chin), 170 in all.

Names say the person's own side (`face_left_*` is on the person's left) so flip pairs follow
from the names. Each point has a position (x, y) on the front of the head's unit sphere
(x to the person's left, y up; z = sqrt(1 - x^2 - y^2) faces forward): the synthetic generator
places the landmarks there, and the template documents where each name sits on a face.
"""

from __future__ import annotations

import numpy as np

_SIDES = (("right", -1.0), ("left", 1.0))


def _jaw(t: float) -> tuple[float, float]:
    """Jaw contour: t = -1 at the right ear, 0 at the chin, 1 at the left ear."""
    phi = t * np.pi / 2
    return 0.86 * np.sin(phi), 0.05 - 0.85 * np.cos(phi)


def _brow(s: float, t: float, lower: bool = False) -> tuple[float, float]:
    """Brow arch on side s, t = 0 at the outer end, 1 at the inner end."""
    return s * (0.50 - 0.32 * t), 0.25 + 0.05 * np.sin(np.pi * t) - (0.045 if lower else 0.0)


def _eye(s: float, a: float) -> tuple[float, float]:
    """Eye outline on side s as an ellipse: a = 0 at the outer corner, pi at the inner corner,
    upper lid for a in (0, pi)."""
    return s * (0.32 + 0.09 * np.cos(a)), 0.12 + 0.035 * np.sin(a)


# iBUG-68 face in its own order; each entry (name, x, y).
def _ibug68() -> list[tuple[str, float, float]]:
    pts: list[tuple[str, float, float]] = []
    for i in range(17):
        k = abs(8 - i)
        name = "face_chin" if i == 8 else f"face_{'right' if i < 8 else 'left'}_jaw_{k}"
        pts.append((name, *_jaw((i - 8) / 8)))
    for k in range(5):  # right brow outer -> inner
        pts.append((f"face_right_brow_{k + 1}", *_brow(-1.0, k / 4)))
    for k in reversed(range(5)):  # left brow inner -> outer
        pts.append((f"face_left_brow_{k + 1}", *_brow(1.0, k / 4)))
    for k, y in enumerate((0.12, 0.02, -0.08, -0.18)):
        pts.append((f"face_nose_bridge_{k + 1}", 0.0, y))
    for name, x, y in (("face_right_nostril_2", -0.14, -0.30), ("face_right_nostril_1", -0.07, -0.32),
                       ("face_subnasale", 0.0, -0.33), ("face_left_nostril_1", 0.07, -0.32),
                       ("face_left_nostril_2", 0.14, -0.30)):
        pts.append((name, x, y))
    eye_names = ("outer_corner", "upper_1", "upper_2", "inner_corner", "lower_2", "lower_1")
    eye_angles = (0.0, np.pi / 3, 2 * np.pi / 3, np.pi, 4 * np.pi / 3, 5 * np.pi / 3)
    for name, a in zip(eye_names, eye_angles):  # right eye from its outer corner, clockwise
        pts.append((f"face_right_eye_{name}", *_eye(-1.0, a)))
    for i in (3, 2, 1, 0, 5, 4):  # left eye from its inner corner: the mirror of the right
        pts.append((f"face_left_eye_{eye_names[i]}", *_eye(1.0, eye_angles[i])))
    for name, x, y in _lips():
        pts.append((name, x, y))
    return pts


def _lips() -> list[tuple[str, float, float]]:
    """Outer lip contour 48-59 and inner 60-67, iBUG order (clockwise from the right corner)."""
    outer = [("face_right_mouth_corner", -0.24, -0.50), ("face_right_upper_lip_outer_2", -0.15, -0.43),
             ("face_right_upper_lip_outer_1", -0.06, -0.415), ("face_upper_lip_outer_centre", 0.0, -0.425),
             ("face_left_upper_lip_outer_1", 0.06, -0.415), ("face_left_upper_lip_outer_2", 0.15, -0.43),
             ("face_left_mouth_corner", 0.24, -0.50), ("face_left_lower_lip_outer_2", 0.15, -0.56),
             ("face_left_lower_lip_outer_1", 0.06, -0.58), ("face_lower_lip_outer_centre", 0.0, -0.585),
             ("face_right_lower_lip_outer_1", -0.06, -0.58), ("face_right_lower_lip_outer_2", -0.15, -0.56)]
    inner = [("face_right_inner_mouth_corner", -0.20, -0.50), ("face_right_upper_lip_inner", -0.08, -0.47),
             ("face_upper_lip_inner_centre", 0.0, -0.47), ("face_left_upper_lip_inner", 0.08, -0.47),
             ("face_left_inner_mouth_corner", 0.20, -0.50), ("face_left_lower_lip_inner", 0.08, -0.53),
             ("face_lower_lip_inner_centre", 0.0, -0.535), ("face_right_lower_lip_inner", -0.08, -0.53)]
    return outer + inner


def _midpoints(pts: list[tuple[str, float, float]], names: list[str]) -> list[tuple[str, float, float]]:
    """Points halfway between consecutive points of a closed contour, named in order."""
    n = len(pts)
    out = []
    for i, name in enumerate(names):
        (_, x0, y0), (_, x1, y1) = pts[i], pts[(i + 1) % n]
        out.append((name, 0.5 * (x0 + x1), 0.5 * (y0 + y1)))
    return out


def _dense170(ibug: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    pts: list[tuple[str, float, float]] = []
    for side, s in _SIDES:
        pts += [(f"face_{side}_jaw_mid_{k}", *_jaw(s * (k - 0.5) / 8)) for k in range(1, 9)]
    for side, s in _SIDES:
        pts += [(f"face_{side}_brow_mid_{k}", *_brow(s, (k - 0.5) / 4)) for k in range(1, 5)]
        pts += [(f"face_{side}_brow_lower_{k}", *_brow(s, (k - 1) / 4, lower=True)) for k in range(1, 6)]
    for side, s in _SIDES:
        pts += [(f"face_{side}_eye_mid_{k}", *_eye(s, (k - 0.5) * np.pi / 3)) for k in range(1, 7)]
        cx, cy = _eye(s, np.pi / 2)[0], 0.12
        pts.append((f"face_{side}_pupil", cx, cy))
        pts += [(f"face_{side}_iris_{n}", cx + s * dx, cy + dy)
                for n, dx, dy in (("top", 0, 0.025), ("outer", 0.025, 0), ("bottom", 0, -0.025),
                                  ("inner", -0.025, 0))]
    pts += [(f"face_nose_bridge_mid_{k}", 0.0, y) for k, y in enumerate((0.07, -0.03, -0.13), 1)]
    for side, s in _SIDES:
        pts += [(f"face_{side}_nostril_mid_{k}", s * x, y)
                for k, x, y in ((1, 0.035, -0.33), (2, 0.105, -0.31))]
        pts += [(f"face_{side}_alar_{k}", s * x, y) for k, x, y in ((1, 0.09, -0.16), (2, 0.13, -0.22),
                                                                    (3, 0.16, -0.27))]
    outer, inner = ibug[48:60], ibug[60:68]
    outer_mids = _midpoints(outer, [f"face_{s}_{u}_lip_outer_mid_{k}" for s, u, k in
                                    (("right", "upper", 3), ("right", "upper", 2), ("right", "upper", 1),
                                     ("left", "upper", 1), ("left", "upper", 2), ("left", "upper", 3),
                                     ("left", "lower", 3), ("left", "lower", 2), ("left", "lower", 1),
                                     ("right", "lower", 1), ("right", "lower", 2), ("right", "lower", 3))])
    inner_mids = _midpoints(inner, [f"face_{s}_{u}_lip_inner_mid_{k}" for s, u, k in
                                    (("right", "upper", 2), ("right", "upper", 1), ("left", "upper", 1),
                                     ("left", "upper", 2), ("left", "lower", 2), ("left", "lower", 1),
                                     ("right", "lower", 1), ("right", "lower", 2))])
    pts += outer_mids + inner_mids
    for r, y in enumerate((0.40, 0.52, 0.64), 1):
        pts.append((f"face_forehead_{r}", 0.0, y))
        for side, s in _SIDES:
            pts += [(f"face_{side}_forehead_{r}_{c}", s * 0.15 * c, y) for c in (1, 2)]
    for side, s in _SIDES:
        pts += [(f"face_{side}_cheek_{r}_{c}", s * (0.18 + 0.12 * c), 0.07 - 0.12 * r)
                for r in range(1, 5) for c in range(1, 5)]
        pts += [(f"face_{side}_temple_{k}", s * 0.68, 0.03 + 0.12 * k) for k in range(1, 4)]
        pts += [(f"face_{side}_nasolabial_{k}", s * (0.16 + 0.04 * (k - 1)), -0.28 - 0.06 * (k - 1))
                for k in range(1, 5)]
        pts += [(f"face_{side}_infraorbital_{k}", s * (0.22 + 0.055 * (k - 1)), 0.0) for k in range(1, 6)]
    pts += [("face_glabella", 0.0, 0.24), ("face_philtrum", 0.0, -0.38),
            ("face_labiomental_groove", 0.0, -0.64), ("face_chin_centre", 0.0, -0.72)]
    for side, s in _SIDES:
        pts += [(f"face_{side}_philtrum_ridge", s * 0.04, -0.38), (f"face_{side}_chin_1", s * 0.12, -0.70),
                (f"face_{side}_chin_2", s * 0.24, -0.66)]
    return pts


def _template() -> list[tuple[str, float, float]]:
    ibug = _ibug68()
    return ibug + _dense170(ibug)


_TEMPLATE = _template()
FACE_NAMES: tuple[str, ...] = tuple(name for name, _, _ in _TEMPLATE)
FACE_XY: np.ndarray = np.array([(x, y) for _, x, y in _TEMPLATE], dtype=np.float64)
FACE_XY.setflags(write=False)
NUM_IBUG = 68

# COCO-WholeBody OKS sigmas of its 68 face points (iBUG order), applied to face points 0-67.
WHOLEBODY_FACE_SIGMAS: tuple[float, ...] = (
    0.042, 0.043, 0.044, 0.043, 0.040, 0.035, 0.031, 0.025, 0.020, 0.023, 0.029, 0.032, 0.037,
    0.038, 0.043, 0.041, 0.045, 0.013, 0.012, 0.011, 0.011, 0.012, 0.012, 0.011, 0.011, 0.013,
    0.015, 0.009, 0.007, 0.007, 0.007, 0.012, 0.009, 0.008, 0.016, 0.010, 0.017, 0.011, 0.009,
    0.011, 0.009, 0.007, 0.013, 0.008, 0.011, 0.012, 0.010, 0.034, 0.008, 0.008, 0.009, 0.008,
    0.008, 0.007, 0.010, 0.008, 0.009, 0.009, 0.009, 0.007, 0.007, 0.008, 0.011, 0.008, 0.008,
    0.008, 0.010, 0.008,
)
