"""Label tables shared by the generator and its consumers: seg classes, COCO keypoints, flips."""

from __future__ import annotations

import numpy as np

# The 29 body-part classes of the Sapiens2 segmentation head, in class-id order.
SEG_CLASSES: tuple[str, ...] = (
    "Background", "Apparel", "Eyeglass", "Face_Neck", "Hair",
    "Left_Foot", "Left_Hand", "Left_Lower_Arm", "Left_Lower_Leg", "Left_Shoe",
    "Left_Sock", "Left_Upper_Arm", "Left_Upper_Leg", "Lower_Clothing", "Right_Foot",
    "Right_Hand", "Right_Lower_Arm", "Right_Lower_Leg", "Right_Shoe", "Right_Sock",
    "Right_Upper_Arm", "Right_Upper_Leg", "Torso", "Upper_Clothing", "Lower_Lip",
    "Upper_Lip", "Lower_Teeth", "Upper_Teeth", "Tongue",
)
SEG_ID: dict[str, int] = {name: i for i, name in enumerate(SEG_CLASSES)}


def _seg_flip() -> np.ndarray:
    """Class permutation under a horizontal image flip: the person's left becomes their right."""
    flip = np.arange(len(SEG_CLASSES), dtype=np.int64)
    for i, name in enumerate(SEG_CLASSES):
        for a, b in (("Left_", "Right_"), ("Right_", "Left_")):
            if name.startswith(a):
                flip[i] = SEG_ID[b + name[len(a):]]
    return flip


SEG_FLIP: np.ndarray = _seg_flip()
SEG_FLIP.setflags(write=False)

KEYPOINT_NAMES: tuple[str, ...] = (
    "nose", "left_eye", "right_eye", "left_ear", "right_ear",
    "left_shoulder", "right_shoulder", "left_elbow", "right_elbow", "left_wrist", "right_wrist",
    "left_hip", "right_hip", "left_knee", "right_knee", "left_ankle", "right_ankle",
)
KEYPOINT_ID: dict[str, int] = {name: i for i, name in enumerate(KEYPOINT_NAMES)}

# COCO limb connections (0-based indices into KEYPOINT_NAMES).
SKELETON: tuple[tuple[int, int], ...] = (
    (15, 13), (13, 11), (16, 14), (14, 12), (11, 12), (5, 11), (6, 12), (5, 6), (5, 7),
    (6, 8), (7, 9), (8, 10), (1, 2), (0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6),
)
FLIP_PAIRS: tuple[tuple[int, int], ...] = (
    (1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14), (15, 16),
)


def _keypoint_seg_classes() -> tuple[frozenset[int], ...]:
    """Seg classes a visible keypoint may land on (its own part, its neighbours, covering clothes).

    Used to check label consistency: a visible left wrist must project onto the left forearm,
    left hand or a long sleeve, never onto the right leg.
    """
    face = {"Face_Neck", "Hair", "Eyeglass", "Apparel", "Upper_Lip", "Lower_Lip",
            "Upper_Teeth", "Lower_Teeth", "Tongue"}
    table: list[set[str]] = [face, face, face, face, face]  # joints below: left, then right
    for side in ("Left", "Right"):
        table.append({f"{side}_Upper_Arm", "Torso", "Upper_Clothing", "Hair", "Apparel",
                      "Face_Neck"})
    for side in ("Left", "Right"):
        table.append({f"{side}_Upper_Arm", f"{side}_Lower_Arm", "Upper_Clothing"})
    for side in ("Left", "Right"):
        table.append({f"{side}_Lower_Arm", f"{side}_Hand", "Upper_Clothing"})
    for side in ("Left", "Right"):
        table.append({f"{side}_Upper_Leg", "Lower_Clothing", "Upper_Clothing", "Torso",
                      "Apparel"})
    for side in ("Left", "Right"):
        table.append({f"{side}_Upper_Leg", f"{side}_Lower_Leg", "Lower_Clothing"})
    for side in ("Left", "Right"):
        table.append({f"{side}_Lower_Leg", f"{side}_Foot", f"{side}_Shoe", f"{side}_Sock",
                      "Lower_Clothing"})
    return tuple(frozenset(SEG_ID[n] for n in names) for names in table)


KEYPOINT_SEG_CLASSES: tuple[frozenset[int], ...] = _keypoint_seg_classes()
