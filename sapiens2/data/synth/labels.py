"""Label tables shared by the generator and its consumers: seg classes, keypoints, flips."""

from __future__ import annotations

import numpy as np

from sapiens2.labels.keypoints308 import KEYPOINT308_NAMES
from sapiens2.labels import COCO_FLIP_PAIRS, COCO_KEYPOINT_NAMES, COCO_SKELETON, SEG_CLASSES
from sapiens2.labels import SEG_FLIP as _SEG_FLIP

SEG_ID: dict[str, int] = {name: i for i, name in enumerate(SEG_CLASSES)}


SEG_FLIP: np.ndarray = np.asarray(_SEG_FLIP, dtype=np.int64)
SEG_FLIP.setflags(write=False)

KEYPOINT_NAMES = COCO_KEYPOINT_NAMES
KEYPOINT_ID: dict[str, int] = {name: i for i, name in enumerate(KEYPOINT_NAMES)}

SKELETON = COCO_SKELETON
FLIP_PAIRS = COCO_FLIP_PAIRS


_FACE = frozenset({"Face_Neck", "Hair", "Eyeglass", "Apparel", "Upper_Lip", "Lower_Lip",
                   "Upper_Teeth", "Lower_Teeth", "Tongue"})


def _keypoint_seg_classes() -> tuple[frozenset[int], ...]:
    """Seg classes a visible keypoint may land on (its own part, its neighbours, covering clothes).

    Used to check label consistency: a visible left wrist must project onto the left forearm,
    left hand or a long sleeve, never onto the right leg.
    """
    face = set(_FACE)
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


def _wholebody_classes(name: str) -> frozenset[str]:
    """Seg classes a visible keypoint of the 308 set beyond COCO's 17 may land on."""
    side = {"left": "Left", "right": "Right"}.get(name.split("_")[0], "")
    if name.startswith("face_"):
        return _FACE
    if name == "neck":
        return frozenset({"Face_Neck", "Torso", "Upper_Clothing", "Hair", "Apparel"})
    if name.endswith(("_toe", "_heel")):
        return frozenset({f"{side}_Foot", f"{side}_Shoe", f"{side}_Sock", f"{side}_Lower_Leg",
                          "Lower_Clothing"})
    if name.endswith("_acromion"):
        return frozenset({f"{side}_Upper_Arm", "Torso", "Upper_Clothing", "Hair", "Apparel",
                          "Face_Neck"})
    if name.endswith(("_olecranon", "_cubital_fossa")):
        return frozenset({f"{side}_Upper_Arm", f"{side}_Lower_Arm", "Upper_Clothing"})
    return frozenset({f"{side}_Hand", f"{side}_Lower_Arm", "Upper_Clothing"})  # fingers


KEYPOINT308_SEG_CLASSES: tuple[frozenset[int], ...] = KEYPOINT_SEG_CLASSES + tuple(
    frozenset(SEG_ID[c] for c in _wholebody_classes(name)) for name in KEYPOINT308_NAMES[17:]
)
