"""Dense probe of pretraining: do patch features align semantically across subjects?

For a patch on one person, the most cosine-similar patch on another person should lie on the
same coarse body part (the capability the Sapiens2 project page shows), against the chance of a
random patch of that person. `patch_image_identity` says why a backbone fails it: when a patch's
feature mostly encodes which image it came from, nearest-patch matching across people is left to
a small residual.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from sapiens2.labels import SEG_CLASSES


def as_numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


# Coarse groups, so that even the 8x6 patch grid of a 128x96 image has patches of one part.
PART_GROUPS: tuple[str, ...] = ("head", "torso", "arm", "leg", "foot")
PART_GROUP_CLASSES: dict[str, tuple[str, ...]] = {
    "head": ("Face_Neck", "Hair", "Eyeglass", "Lower_Lip", "Upper_Lip", "Lower_Teeth",
             "Upper_Teeth", "Tongue", "Apparel"),
    "torso": ("Torso", "Upper_Clothing"),
    "arm": ("Left_Upper_Arm", "Left_Lower_Arm", "Left_Hand",
            "Right_Upper_Arm", "Right_Lower_Arm", "Right_Hand"),
    "leg": ("Left_Upper_Leg", "Left_Lower_Leg", "Right_Upper_Leg", "Right_Lower_Leg",
            "Lower_Clothing"),
    "foot": ("Left_Foot", "Left_Shoe", "Left_Sock", "Right_Foot", "Right_Shoe", "Right_Sock"),
}
# Lookup over every uint8 seg value: class id -> group id, -1 for Background and 255 (ignore).
SEG_TO_PART_GROUP = np.full(256, -1, np.int64)
for _group, _names in enumerate(PART_GROUP_CLASSES.values()):
    SEG_TO_PART_GROUP[[SEG_CLASSES.index(name) for name in _names]] = _group


def patch_part_labels(seg: Any, grid: Sequence[int], patch_size: int) -> np.ndarray:
    """Coarse body-part group per patch (N, h, w) int64 from seg maps (N, H, W) of SEG_CLASSES.

    The majority group (index into PART_GROUPS) of the patch's part pixels; -1 when under half of
    its pixels are part pixels (background and ignore are not), since such a patch's feature is
    mostly about the scene.
    """
    h, w = grid
    seg = as_numpy(seg)
    if seg.shape[1] < h * patch_size or seg.shape[2] < w * patch_size:
        raise ValueError(f"seg {seg.shape[1:]} is smaller than grid {tuple(grid)} x {patch_size}")
    groups = SEG_TO_PART_GROUP[seg[:, : h * patch_size, : w * patch_size].astype(np.int64)]
    cells = groups.reshape(len(seg), h, patch_size, w, patch_size).transpose(0, 1, 3, 2, 4)
    cells = cells.reshape(len(seg), h, w, patch_size * patch_size)
    counts = np.stack([(cells == g).sum(-1) for g in range(len(PART_GROUPS))], -1)
    mostly_person = 2 * counts.sum(-1) >= patch_size * patch_size
    return np.where(mostly_person, counts.argmax(-1), -1).astype(np.int64)


def sample_image_pairs(num_images: int, seed: int = 0, max_pairs: int = 2000) -> np.ndarray:
    """Ordered pairs (a, b), a != b, (M, 2) int64: all of them when at most max_pairs, else
    max_pairs distinct ones drawn with the seed."""
    total = num_images * (num_images - 1)
    flat = np.arange(total) if total <= max_pairs else np.sort(
        np.random.default_rng(seed).choice(total, max_pairs, replace=False)
    )
    # Pair index -> (a, r): r counts b over the other images, skipping a itself.
    a, r = np.divmod(flat, max(num_images - 1, 1))
    return np.stack([a, r + (r >= a)], 1).astype(np.int64)


def _resolve_pairs(num_images: int, pairs: Any, seed: int, max_pairs: int) -> np.ndarray:
    pairs = sample_image_pairs(num_images, seed, max_pairs) if pairs is None else as_numpy(pairs)
    pairs = pairs.reshape(-1, 2).astype(np.int64)
    if np.any(pairs[:, 0] == pairs[:, 1]):
        raise ValueError("part correspondence pairs must be of two different images")
    return pairs


def part_correspondence_accuracy(
    patches: Any, part_labels: Any, pairs: Any = None, seed: int = 0, max_pairs: int = 2000
) -> float:
    """Share of labelled patches of image a whose most cosine-similar labelled patch of image b
    has the same part group, pooled over the ordered image pairs (a, b)."""
    labels = as_numpy(part_labels).reshape(len(part_labels), -1)
    feats = np.ascontiguousarray(as_numpy(patches).reshape(*labels.shape, -1), dtype=np.float32)
    feats /= np.maximum(np.linalg.norm(feats, axis=-1, keepdims=True), 1e-12)
    matches = queries = 0
    for a, b in _resolve_pairs(len(labels), pairs, seed, max_pairs):
        in_a, in_b = labels[a] != -1, labels[b] != -1
        if not in_a.any() or not in_b.any():
            continue
        nearest = (feats[a][in_a] @ feats[b][in_b].T).argmax(1)
        matches += int(np.sum(labels[b][in_b][nearest] == labels[a][in_a]))
        queries += int(in_a.sum())
    if not queries:
        raise ValueError("no image pair has labelled patches on both sides")
    return matches / queries


def part_correspondence_chance(
    part_labels: Any, pairs: Any = None, seed: int = 0, max_pairs: int = 2000
) -> float:
    """Expected part_correspondence_accuracy when b's patch is drawn uniformly among its labelled
    patches: for a patch of group g, P(match) = share of g among b's labelled patches."""
    labels = as_numpy(part_labels).reshape(len(part_labels), -1)
    groups = range(len(PART_GROUPS))
    counts = np.stack([(labels == g).sum(1) for g in groups], 1).astype(np.float64)
    pairs = _resolve_pairs(len(labels), pairs, seed, max_pairs)
    count_a, count_b = counts[pairs[:, 0]], counts[pairs[:, 1]]
    valid = (count_a.sum(1) > 0) & (count_b.sum(1) > 0)
    if not valid.any():
        raise ValueError("no image pair has labelled patches on both sides")
    share_b = count_b[valid] / count_b[valid].sum(1, keepdims=True)
    return float((count_a[valid] * share_b).sum() / count_a[valid].sum())


def patch_image_identity(patches: Any, part_labels: Any) -> float:
    """Mean cosine of two part patches of one image minus that of two part patches of different
    images, on the features as given (N, h, w, D) with part labels (N, h, w), -1 skipped.

    Near 0 when a patch's feature is about its content; large when it mostly says which image
    it came from. Closed form over per-image sums of unit vectors: for an image with n unit
    features summing to s, its within-image pair cosines add up to |s|^2 - n.
    """
    labels = as_numpy(part_labels).reshape(len(part_labels), -1)
    feats = as_numpy(patches).reshape(*labels.shape, -1).astype(np.float64)
    feats /= np.maximum(np.linalg.norm(feats, axis=-1, keepdims=True), 1e-12)
    feats *= (labels != -1)[..., None]
    counts = (labels != -1).sum(1).astype(np.float64)
    per_image = feats.sum(1)
    square_norms = (per_image ** 2).sum(1)
    within_pairs, across_pairs = (counts * (counts - 1)).sum(), counts.sum() ** 2 - (counts ** 2).sum()
    if within_pairs <= 0 or across_pairs <= 0:
        raise ValueError("patch_image_identity needs two images with part patches, one with two")
    within = (square_norms - counts).sum() / within_pairs
    across = ((per_image.sum(0) ** 2).sum() - square_norms.sum()) / across_pairs
    return float(within - across)
