"""The 308-keypoint whole-body set of the Sapiens2 pose models: names, groups, OKS sigmas, flips.

Order (facts, section 4): 17 body, 6 foot, 2 x 20 hands, 7 extra, 238 face.

- body 0-16: the 17 COCO keypoints in COCO order, so COCO labels are a prefix of the set;
- foot 17-22: COCO-WholeBody's foot points (big toe, small toe, heel; left foot first);
- hands 23-62: right hand 23-42, then left hand 43-62; per hand the five fingers thumb,
  forefinger, middle, ring, pinky, each from its base to its tip (thumb: cmc, mcp, ip, tip;
  others: mcp, pip, dip, tip). These are COCO-WholeBody's hand points 1-20; its point 0 (the
  hand root) is the body wrist here;
- extra 63-69: olecranon (back of the elbow), cubital fossa (inner elbow) and acromion
  (shoulder tip) per side, then the neck;
- face 70-307: the 238 landmarks of `sapiens2.labels.face238` (first its 68 iBUG points).

OKS sigmas are COCO-WholeBody's wherever a point has a COCO-WholeBody counterpart (body, foot,
hand, the 68 iBUG face points) and 0.010 elsewhere. Left/right are the person's own and the flip
pairs follow from the names (left <-> right), as `mirror_class_map` does for part classes.
"""

from __future__ import annotations

from sapiens2.labels.face238 import FACE_NAMES, NUM_IBUG, WHOLEBODY_FACE_SIGMAS
from sapiens2.labels import COCO_KEYPOINT_NAMES, COCO_OKS_SIGMAS, COCO_SKELETON

DEFAULT_SIGMA = 0.010
FOOT_NAMES = ("left_big_toe", "left_small_toe", "left_heel",
              "right_big_toe", "right_small_toe", "right_heel")
FOOT_SIGMAS = (0.068, 0.066, 0.066, 0.092, 0.094, 0.094)
FINGERS = ("thumb", "forefinger", "middle_finger", "ring_finger", "pinky_finger")
FINGER_JOINTS = {"thumb": ("cmc", "mcp", "ip", "tip")} | {
    f: ("mcp", "pip", "dip", "tip") for f in FINGERS[1:]}
# COCO-WholeBody hand sigmas for its points 1-20 (its point 0, the hand root, is our wrist).
HAND_SIGMAS = (0.022, 0.035, 0.037, 0.047, 0.026, 0.025, 0.024, 0.035, 0.018, 0.024,
               0.022, 0.026, 0.017, 0.021, 0.021, 0.032, 0.020, 0.019, 0.022, 0.031)
EXTRA_NAMES = ("left_olecranon", "right_olecranon", "left_cubital_fossa", "right_cubital_fossa",
               "left_acromion", "right_acromion", "neck")


def hand_names(side: str) -> tuple[str, ...]:
    return tuple(f"{side}_{finger}_{joint}" for finger in FINGERS for joint in FINGER_JOINTS[finger])


KEYPOINT308_NAMES: tuple[str, ...] = (
    COCO_KEYPOINT_NAMES + FOOT_NAMES + hand_names("right") + hand_names("left") + EXTRA_NAMES
    + FACE_NAMES
)
NUM_KEYPOINTS308 = len(KEYPOINT308_NAMES)
KEYPOINT308_ID: dict[str, int] = {name: i for i, name in enumerate(KEYPOINT308_NAMES)}

# Index groups for per-subset evaluation; "hands" is both hands together.
KEYPOINT308_GROUPS: dict[str, tuple[int, ...]] = {
    "body": tuple(range(0, 17)),
    "foot": tuple(range(17, 23)),
    "hands": tuple(range(23, 63)),
    "extra": tuple(range(63, 70)),
    "face": tuple(range(70, 308)),
}

KEYPOINT308_OKS_SIGMAS: tuple[float, ...] = (
    COCO_OKS_SIGMAS + FOOT_SIGMAS + HAND_SIGMAS * 2 + (DEFAULT_SIGMA,) * len(EXTRA_NAMES)
    + WHOLEBODY_FACE_SIGMAS + (DEFAULT_SIGMA,) * (len(FACE_NAMES) - NUM_IBUG)
)


def mirror_name(name: str) -> str:
    """The keypoint's name on the other side of the body (unchanged on the midline)."""
    swap = {"left": "right", "right": "left"}
    return "_".join(swap.get(token, token) for token in name.split("_"))


def flip_pairs(names: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """(left-or-first, other) index pairs of points whose mirrored name is another point."""
    index = {n: i for i, n in enumerate(names)}
    pairs = []
    for i, name in enumerate(names):
        j = index.get(mirror_name(name), i)
        if i < j:
            pairs.append((i, j))
    return tuple(pairs)


KEYPOINT308_FLIP_PAIRS = flip_pairs(KEYPOINT308_NAMES)


def _chain(names: list[str]) -> list[tuple[str, str]]:
    return list(zip(names[:-1], names[1:]))


def _skeleton_names() -> list[tuple[str, str]]:
    """Limbs for drawing: COCO's, foot, fingers, elbow/shoulder landmarks and face contours."""
    bones: list[tuple[str, str]] = []
    for side in ("left", "right"):
        bones += [(f"{side}_ankle", f"{side}_heel"), (f"{side}_ankle", f"{side}_big_toe"),
                  (f"{side}_big_toe", f"{side}_small_toe")]
        for finger in FINGERS:
            joints = [f"{side}_{finger}_{j}" for j in FINGER_JOINTS[finger]]
            bones += _chain([f"{side}_wrist"] + joints)
        bones += [(f"{side}_elbow", f"{side}_olecranon"), (f"{side}_elbow", f"{side}_cubital_fossa"),
                  (f"{side}_shoulder", f"{side}_acromion"), ("neck", f"{side}_acromion")]
    face = FACE_NAMES
    jaw = [face[i] for i in range(17)]
    brows = [face[17:22], face[22:27]]
    nose = [face[27:31], face[31:36]]
    eyes = [face[36:42] + face[36:37], face[42:48] + face[42:43]]
    lips = [face[48:60] + face[48:49], face[60:68] + face[60:61]]
    for contour in [jaw, *brows, *nose, *eyes, *lips]:
        bones += _chain(list(contour))
    return bones


KEYPOINT308_SKELETON: tuple[tuple[int, int], ...] = COCO_SKELETON + tuple(
    (KEYPOINT308_ID[a], KEYPOINT308_ID[b]) for a, b in _skeleton_names()
)
