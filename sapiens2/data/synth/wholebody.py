"""The 308 whole-body keypoints on the articulated body: feet, fingers, elbow and shoulder
landmarks, neck and 238 face landmarks, placed on the surfaces of the shapes that render them.

Points lie on (or just under) the ellipsoid or capsule surface of their body part, so the
ray-cast depth decides their visibility exactly as for the 17 COCO joints: a point is visible
when the first surface at its pixel is one of its owner shapes and lies within its tolerance in
front of it. All positions are deterministic functions of the skeleton and shapes (no random
draws), so asking for the 308 set changes no image or dense label of a sample.
"""

from __future__ import annotations

import numpy as np

from sapiens2.data.synth.body import _FACE_OWNERS, SIDES, Keypoints3D, Skeleton, keypoints_3d
from sapiens2.data.synth.pose import BodyShape
from sapiens2.data.synth.primitives import Ellipsoid, Shape
from sapiens2.labels.face238 import FACE_XY
from sapiens2.labels.keypoints308 import FINGERS

# Finger joints (base to tip) on the back of the hand ellipsoid, in its unit coordinates:
# y runs along the hand (fingers towards -y), z across it (thumb side +z), x through the palm.
_FINGER_Y = (-0.25, -0.55, -0.75, -0.92)
_FINGER_Z = {"forefinger": 0.55, "middle_finger": 0.18, "ring_finger": -0.18, "pinky_finger": -0.55}
_THUMB = ((0.45, 0.85), (0.15, 0.93), (-0.15, 0.95), (-0.40, 0.90))  # (y, share of the z extent)
# Foot points on the foot ellipsoid (x to the person's left, z towards the toes), for the left
# foot; the right foot mirrors x. The big toe sits on the inner (medial) side.
_FOOT_DIRS = {"big_toe": (-0.40, -0.20, 0.89), "small_toe": (0.55, -0.20, 0.81),
              "heel": (0.0, -0.35, -0.94)}


def _on_ellipsoid(shape: Ellipsoid, unit: np.ndarray) -> np.ndarray:
    """Surface points of `shape` in the directions `unit` (rows) of its unit sphere."""
    unit = unit / np.linalg.norm(unit, axis=1, keepdims=True)
    return shape.centre + (unit * shape.axes) @ shape.frame.T


def _hand_units(sign: float) -> np.ndarray:
    """Unit-sphere points of the 20 finger joints on the back of the hand (FINGERS order)."""
    rows = []
    for finger in FINGERS:
        if finger == "thumb":
            joints = [(y, share * np.sqrt(1 - y * y)) for y, share in _THUMB]
        else:
            joints = [(y, _FINGER_Z[finger] * np.sqrt(1 - y * y)) for y in _FINGER_Y]
        # The back of the hand faces away from the body: +x for the left hand, -x the right.
        rows += [(sign * np.sqrt(max(1 - y * y - z * z, 0.0)), y, z) for y, z in joints]
    return np.asarray(rows)


def keypoints308_3d(sk: Skeleton, shape: BodyShape, shapes: list[Shape]) -> Keypoints3D:
    """The 308 keypoints in the body frame (sapiens2.labels.keypoints308 order) from the posed
    skeleton and the shapes `build_shapes` made for it."""
    by_name = {s.name: s for s in shapes if s.name not in ("hair", "hat", "glasses", "bag")}
    coco = keypoints_3d(sk, shape)
    points, owners, tol = list(coco.points), list(coco.owners), list(coco.tolerance)
    s = shape.height / 1.75

    def add(pts: np.ndarray, owner: frozenset[str], tolerance: float) -> None:
        points.extend(pts)
        owners.extend([owner] * len(pts))
        tol.extend([tolerance] * len(pts))

    for side, _, sign in SIDES:  # left foot, then right (COCO-WholeBody order)
        dirs = np.array([_FOOT_DIRS[k] for k in ("big_toe", "small_toe", "heel")]) * [sign, 1, 1]
        add(_on_ellipsoid(by_name[f"{side}_foot"], dirs),
            frozenset({f"{side}_foot", f"{side}_lower_leg"}), 0.03 * s)
    for side, _, sign in reversed(SIDES):  # right hand, then left
        add(_on_ellipsoid(by_name[f"{side}_hand"], _hand_units(sign)),
            frozenset({f"{side}_hand", f"{side}_lower_arm"}), 0.05 * s)
    r = sk.radii
    for side, _, _ in SIDES:
        back = -sk.frames[f"{side}_upper_arm"][:, 2]  # the forearm bends towards +z
        add(sk.joints[f"{side}_elbow"][None] + r["upper_arm"] * back,
            frozenset({f"{side}_upper_arm", f"{side}_lower_arm"}), 0.02 * s)
    for side, _, _ in SIDES:
        front = sk.frames[f"{side}_upper_arm"][:, 2]
        add(sk.joints[f"{side}_elbow"][None] + 0.8 * r["upper_arm"] * front,
            frozenset({f"{side}_upper_arm", f"{side}_lower_arm"}), 1.6 * r["upper_arm"])
    for side, _, _ in SIDES:
        top = sk.frames["chest"][:, 1]
        add(sk.joints[f"{side}_shoulder"][None] + r["girdle"] * top,
            frozenset({"girdle", "chest", f"{side}_upper_arm", "hair", "neck"}), 0.03 * s)
    add(sk.joints["neck"][None], frozenset({"neck", "girdle", "chest", "head", "hair"}),
        1.6 * r["neck"])
    xy = np.asarray(FACE_XY)
    face_units = np.column_stack([xy, np.sqrt(1 - (xy ** 2).sum(1))])
    add(_on_ellipsoid(by_name["head"], face_units), _FACE_OWNERS | {"neck"}, 0.03)
    return Keypoints3D(np.asarray(points), tuple(owners), np.asarray(tol))
