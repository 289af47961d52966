"""Probes of what self-supervised pretraining learned, read off frozen backbone features.

Two label-free capabilities the Sapiens2 project page claims for pretraining, each with the
floor it must beat (callers also compare a trained backbone with a randomly initialised one):

- global: a DINO-style weighted k-NN on CLS features recovers the body's viewpoint (front /
  side / back), against always predicting the most common viewpoint;
- dense: patch features align semantically across subjects, so the nearest patch on another
  person lies on the same coarse body part, against a random patch of that person.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import faiss
import numpy as np
import torch
from torch import nn

from sapiens2.labels import COCO_KEYPOINT_NAMES, SEG_CLASSES

FRONT, SIDE, BACK, UNDETERMINED = 0, 1, 2, -1
# (left, right) keypoint indices of the shoulders and of the hips.
TORSO_PAIRS = np.array([
    [COCO_KEYPOINT_NAMES.index(f"{side}_{joint}") for side in ("left", "right")]
    for joint in ("shoulder", "hip")
])

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


def _numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


@torch.no_grad()
def extract_features(
    backbone: nn.Module, batches: Iterable[dict[str, Any]]
) -> tuple[np.ndarray, np.ndarray]:
    """CLS features (N, D) and patch features (N, h, w, D), float32, of every batch's "image".

    Runs in eval mode, then restores the previous mode: probing mid-training changes nothing.
    """
    param = next(backbone.parameters())
    was_training = backbone.training
    backbone.eval()
    cls, patches = [], []
    try:
        for batch in batches:
            images = batch["image"].to(param.device, param.dtype)
            tokens = backbone.forward_tokens(images).float()
            h, w = (size // backbone.patch_size for size in images.shape[-2:])
            cls.append(tokens[:, 0].cpu().numpy())
            patch_tokens = tokens[:, backbone.num_prefix_tokens:]
            patches.append(patch_tokens.reshape(len(images), h, w, -1).cpu().numpy())
    finally:
        backbone.train(was_training)
    if not cls:
        raise ValueError("extract_features got no batches")
    return np.concatenate(cls), np.concatenate(patches)


def viewpoint_bins(keypoints: Any, side_ratio: float = 0.25) -> np.ndarray:
    """Body orientation to the camera per person (N,) int64 from COCO-17 keypoints (N, 17, 3).

    The left-right offset dx = x(left) - x(right) of the shoulders and of the hips (the mean of
    the pairs with both points labelled, visibility > 0) is positive when the person faces the
    camera (their left side appears on the image's right) and negative from behind; it shrinks
    towards 0 as the body turns sideways. Relative to the torso height t (distance between the
    mean labelled shoulder and the mean labelled hip): |dx| < side_ratio * t -> SIDE, else FRONT
    (dx > 0) or BACK (dx < 0). UNDETERMINED when no shoulder or hip pair is labelled, or no
    shoulder or no hip is, so the torso height is unknown.
    """
    kp = _numpy(keypoints).astype(np.float64)
    labelled = kp[..., 2] > 0
    left, right = TORSO_PAIRS[:, 0], TORSO_PAIRS[:, 1]
    both = labelled[:, left] & labelled[:, right]  # (N, 2): shoulder pair, hip pair
    dx = ((kp[:, left, 0] - kp[:, right, 0]) * both).sum(1) / np.maximum(both.sum(1), 1)
    weight = labelled[:, TORSO_PAIRS]  # (N, 2, 2)
    centres = (kp[:, TORSO_PAIRS, :2] * weight[..., None]).sum(2)
    centres /= np.maximum(weight.sum(2), 1)[..., None]  # mean labelled shoulder, mean labelled hip
    torso = np.linalg.norm(centres[:, 0] - centres[:, 1], axis=1)
    bins = np.where(np.abs(dx) < side_ratio * torso, SIDE, np.where(dx > 0, FRONT, BACK))
    determined = both.any(1) & weight.any(2).all(1) & (torso > 0)
    return np.where(determined, bins, UNDETERMINED).astype(np.int64)


def _labelled_unit_rows(feats: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """Rows with a label (!= -1), L2-normalised float32 so inner product is cosine similarity."""
    feats, labels = _numpy(feats), _numpy(labels).astype(np.int64)
    keep = labels != -1
    kept = np.ascontiguousarray(feats[keep], dtype=np.float32)
    faiss.normalize_L2(kept)
    return kept, labels[keep]


def knn_accuracy(
    train_feats: Any, train_labels: Any, query_feats: Any, query_labels: Any,
    k: int = 10, temperature: float = 0.07,
) -> float:
    """Accuracy of DINO's weighted k-NN classifier: each of the k most cosine-similar train
    samples votes for its label with weight exp(sim / temperature). Label -1 is dropped."""
    memory, memory_labels = _labelled_unit_rows(train_feats, train_labels)
    queries, truth = _labelled_unit_rows(query_feats, query_labels)
    if not len(memory) or not len(queries):
        raise ValueError(f"knn_accuracy: {len(memory)} labelled train, {len(queries)} query")
    index = faiss.IndexFlatIP(memory.shape[1])
    index.add(memory)
    sims, neighbours = index.search(queries, min(k, len(memory)))
    classes, neighbour_class = np.unique(memory_labels[neighbours], return_inverse=True)
    votes = np.zeros((len(queries), len(classes)))
    rows = np.repeat(np.arange(len(queries)), neighbours.shape[1])
    weights = np.exp(sims.astype(np.float64) / temperature)
    np.add.at(votes, (rows, neighbour_class.ravel()), weights.ravel())
    return float(np.mean(classes[votes.argmax(1)] == truth))


def majority_accuracy(train_labels: Any, query_labels: Any) -> float:
    """Accuracy of always predicting the most common train label (-1 dropped): the chance bar."""
    train, query = _numpy(train_labels), _numpy(query_labels)
    train, query = train[train != -1], query[query != -1]
    if not len(train) or not len(query):
        raise ValueError(f"majority_accuracy: {len(train)} labelled train, {len(query)} query")
    classes, counts = np.unique(train, return_counts=True)
    return float(np.mean(query == classes[counts.argmax()]))


def patch_part_labels(seg: Any, grid: Sequence[int], patch_size: int) -> np.ndarray:
    """Coarse body-part group per patch (N, h, w) int64 from seg maps (N, H, W) of SEG_CLASSES.

    The majority group (index into PART_GROUPS) of the patch's part pixels; -1 when under half of
    its pixels are part pixels (background and ignore are not), since such a patch's feature is
    mostly about the scene.
    """
    h, w = grid
    seg = _numpy(seg)
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
    pairs = sample_image_pairs(num_images, seed, max_pairs) if pairs is None else _numpy(pairs)
    pairs = pairs.reshape(-1, 2).astype(np.int64)
    if np.any(pairs[:, 0] == pairs[:, 1]):
        raise ValueError("part correspondence pairs must be of two different images")
    return pairs


def part_correspondence_accuracy(
    patches: Any, part_labels: Any, pairs: Any = None, seed: int = 0, max_pairs: int = 2000
) -> float:
    """Share of labelled patches of image a whose most cosine-similar labelled patch of image b
    has the same part group, pooled over the ordered image pairs (a, b)."""
    labels = _numpy(part_labels).reshape(len(part_labels), -1)
    feats = np.ascontiguousarray(_numpy(patches).reshape(*labels.shape, -1), dtype=np.float32)
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
    labels = _numpy(part_labels).reshape(len(part_labels), -1)
    groups = range(len(PART_GROUPS))
    counts = np.stack([(labels == g).sum(1) for g in groups], 1).astype(np.float64)
    pairs = _resolve_pairs(len(labels), pairs, seed, max_pairs)
    count_a, count_b = counts[pairs[:, 0]], counts[pairs[:, 1]]
    valid = (count_a.sum(1) > 0) & (count_b.sum(1) > 0)
    if not valid.any():
        raise ValueError("no image pair has labelled patches on both sides")
    share_b = count_b[valid] / count_b[valid].sum(1, keepdims=True)
    return float((count_a[valid] * share_b).sum() / count_a[valid].sum())


def run_probes(
    backbone: nn.Module,
    train_batches: Iterable[dict[str, Any]],
    val_batches: Iterable[dict[str, Any]],
) -> dict[str, float]:
    """Viewpoint k-NN (train split as memory, val as queries) and part correspondence on val, on
    features centred by their mean (train CLS mean; mean val patch).

    Batches are `sapiens2.data.dataset.collate` dicts with "image", "keypoints" and (val) "seg".
    """
    # Lists, so one-pass loaders can give both the images and their labels.
    train_batches, val_batches = list(train_batches), list(val_batches)

    def stacked(batches: list[dict[str, Any]], field: str) -> np.ndarray:
        return np.concatenate([_numpy(batch[field]) for batch in batches])

    train_cls, _ = extract_features(backbone, train_batches)
    val_cls, val_patches = extract_features(backbone, val_batches)
    # Centred features: a component shared by every image (large in a briefly trained or random
    # ViT) would otherwise make all cosines ~1 and hide what the features do distinguish.
    mean_cls = train_cls.mean(axis=0)
    train_cls, val_cls = train_cls - mean_cls, val_cls - mean_cls
    val_patches = val_patches - val_patches.reshape(-1, val_patches.shape[-1]).mean(axis=0)
    train_views = viewpoint_bins(stacked(train_batches, "keypoints"))
    val_views = viewpoint_bins(stacked(val_batches, "keypoints"))
    grid = val_patches.shape[1:3]
    parts = patch_part_labels(stacked(val_batches, "seg"), grid, backbone.patch_size)
    return {
        "knn_viewpoint_acc": knn_accuracy(train_cls, train_views, val_cls, val_views),
        "viewpoint_majority_acc": majority_accuracy(train_views, val_views),
        "part_correspondence_acc": part_correspondence_accuracy(val_patches, parts),
        "part_correspondence_chance": part_correspondence_chance(parts),
        "num_train_images": float(len(train_cls)),
        "num_val_images": float(len(val_cls)),
    }
