"""Named keypoint sets: everything a pose task, dataset or generator needs to know about one.

"coco17" is the 17 COCO body keypoints the demo recipe trains on; "sapiens308" is the
whole-body set of the reference models (`sapiens2.labels.keypoints308`). `eval_groups` are the subsets
OKS AP is reported for besides the whole set, each scored with its own sigmas.
"""

from __future__ import annotations

from dataclasses import dataclass

from sapiens2.labels import keypoints308 as k308
from sapiens2.labels import COCO_FLIP_PAIRS, COCO_KEYPOINT_NAMES, COCO_OKS_SIGMAS, COCO_SKELETON


@dataclass(frozen=True)
class KeypointSet:
    names: tuple[str, ...]
    flip_pairs: tuple[tuple[int, int], ...]
    oks_sigmas: tuple[float, ...]
    skeleton: tuple[tuple[int, int], ...]
    eval_groups: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def num_keypoints(self) -> int:
        return len(self.names)


KEYPOINT_SETS: dict[str, KeypointSet] = {
    "coco17": KeypointSet(COCO_KEYPOINT_NAMES, COCO_FLIP_PAIRS, COCO_OKS_SIGMAS, COCO_SKELETON),
    "sapiens308": KeypointSet(
        k308.KEYPOINT308_NAMES, k308.KEYPOINT308_FLIP_PAIRS, k308.KEYPOINT308_OKS_SIGMAS,
        k308.KEYPOINT308_SKELETON,
        tuple((g, k308.KEYPOINT308_GROUPS[g]) for g in ("body", "foot", "face", "hands")),
    ),
}


def get_keypoint_set(name: str) -> KeypointSet:
    if name not in KEYPOINT_SETS:
        raise ValueError(f"unknown keypoint set {name!r}; expected one of {tuple(KEYPOINT_SETS)}")
    return KEYPOINT_SETS[name]
