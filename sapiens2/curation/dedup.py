"""Near-duplicate detection: perceptual-hash candidates (BK-tree), geometric verification of
each candidate pair (ORB + RANSAC similarity), union-find grouping, one representative per group.

A 64-bit pHash alone cannot separate crops of one photo from different photos at demo scale:
on the synthetic pool, 6 %-per-side crops sit up to 14 bits from their source while distinct
people on similar backdrops come as close as 8 bits. So the hash only proposes pairs within a
loose radius, and a pair counts as a duplicate when a similarity transform (crop + resize)
maps many ORB keypoints of one image onto the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import cv2
import imagehash
import numpy as np
from PIL import Image
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

# ORB features are extracted at this short side: small images are upscaled so that enough
# corners survive, big ones downscaled so the cost stays bounded.
_FEATURE_SHORT_SIDE = 192


class PhashScorer:
    """DCT perceptual hash (imagehash.phash) as a hex string of ``hash_size**2`` bits."""

    def __init__(self, hash_size: int = 8) -> None:
        self.hash_size = hash_size

    def __call__(self, image: np.ndarray) -> dict[str, str]:
        return {"phash": str(imagehash.phash(Image.fromarray(image), hash_size=self.hash_size))}


@dataclass(frozen=True)
class Keypoints:
    """ORB keypoint positions (N, 2) in the original image's pixels and descriptors (N, 32)."""

    points: np.ndarray
    descriptors: np.ndarray


def orb_keypoints(image: np.ndarray, n_features: int = 300) -> Keypoints:
    height, width = image.shape[:2]
    factor = _FEATURE_SHORT_SIDE / min(height, width)
    grey = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    grey = cv2.resize(grey, (max(1, round(width * factor)), max(1, round(height * factor))),
                      interpolation=cv2.INTER_AREA if factor < 1 else cv2.INTER_LINEAR)
    orb = cv2.ORB_create(nfeatures=n_features, edgeThreshold=8, patchSize=15, fastThreshold=10)
    kps, desc = orb.detectAndCompute(grey, None)
    if desc is None:
        return Keypoints(np.zeros((0, 2), np.float32), np.zeros((0, 32), np.uint8))
    return Keypoints(np.float32([kp.pt for kp in kps]) / factor, desc)


def similarity_inliers(a: Keypoints, b: Keypoints) -> int:
    """Matches consistent with one rotation + uniform scale + translation from ``a`` to ``b``."""
    if len(a.points) < 4 or len(b.points) < 4:
        return 0
    matches = cv2.BFMatcher(cv2.NORM_HAMMING, crossCheck=True).match(a.descriptors, b.descriptors)
    if len(matches) < 4:
        return 0
    src = a.points[[m.queryIdx for m in matches]]
    dst = b.points[[m.trainIdx for m in matches]]
    transform, inliers = cv2.estimateAffinePartial2D(src, dst, method=cv2.RANSAC, ransacReprojThreshold=2.0)
    return 0 if transform is None else int(inliers.sum())


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


class BKTree:
    """Burkhard-Keller tree over integer hashes under the Hamming metric.

    A radius query only descends into children whose edge distance lies within
    ``[d - radius, d + radius]`` (triangle inequality), far below the all-pairs cost for
    small radii.
    """

    def __init__(self) -> None:
        self._root: tuple[int, int, dict] | None = None

    def add(self, value: int, index: int) -> None:
        if self._root is None:
            self._root = (value, index, {})
            return
        node = self._root
        while True:
            dist = hamming(value, node[0])
            child = node[2].get(dist)
            if child is None:
                node[2][dist] = (value, index, {})
                return
            node = child

    def query(self, value: int, radius: int) -> list[int]:
        """Indices of all stored hashes within ``radius`` bits of ``value``."""
        found: list[int] = []
        stack = [self._root] if self._root is not None else []
        while stack:
            node_value, node_index, children = stack.pop()
            dist = hamming(value, node_value)
            if dist <= radius:
                found.append(node_index)
            stack.extend(child for edge, child in children.items() if dist - radius <= edge <= dist + radius)
        return found


def candidate_pairs(hashes: Sequence[str], max_hamming: int) -> list[tuple[int, int, int]]:
    """All (i, j, distance) with i < j whose hex hashes differ in at most ``max_hamming`` bits."""
    tree = BKTree()
    pairs = []
    for j, value in enumerate(int(h, 16) for h in hashes):
        pairs.extend((i, j, hamming(value, int(hashes[i], 16))) for i in tree.query(value, max_hamming))
        tree.add(value, j)
    return sorted(pairs)


@dataclass(frozen=True)
class DuplicateGroups:
    """Per item: ``representative`` index of its group (None for a singleton)."""

    representative: list[int | None]

    def is_duplicate(self, i: int) -> bool:
        return self.representative[i] is not None and self.representative[i] != i


def group_duplicates(
    n: int,
    edges: Sequence[tuple[int, int]],
    priority: Callable[[int], tuple],
) -> DuplicateGroups:
    """Connected components of the duplicate ``edges``; each group keeps the member with the
    smallest ``priority``.

    Grouping is transitive, and the representative depends only on the members' priority keys
    (not on input order), so the choice is deterministic.
    """
    rows, cols = (np.asarray(side, dtype=np.int64) for side in zip(*edges)) if edges else (np.empty(0, np.int64),) * 2
    graph = coo_matrix((np.ones(len(rows), dtype=np.int8), (rows, cols)), shape=(n, n))
    _, labels = connected_components(graph, directed=False)
    members: dict[int, list[int]] = {}
    for i, label in enumerate(labels.tolist()):
        members.setdefault(label, []).append(i)
    representative: list[int | None] = [None] * n
    for items in members.values():
        if len(items) > 1:
            rep = min(items, key=priority)
            for i in items:
                representative[i] = rep
    return DuplicateGroups(representative)
