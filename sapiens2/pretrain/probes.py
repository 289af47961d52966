"""Probes of what self-supervised pretraining learned, read off frozen backbone features.

Two label-free capabilities the Sapiens2 project page claims for pretraining, each with the
floor it must beat (callers also compare a trained backbone with a randomly initialised one):

- global: a DINO-style weighted k-NN on CLS features recovers the body's viewpoint (front /
  side / back), against always predicting the most common viewpoint;
- dense: patch features align semantically across subjects, so the nearest patch on another
  person lies on the same coarse body part, against a random patch of that person
  (`part_probes.py`, which also measures how much a patch's feature says which image it is from).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import faiss
import numpy as np
import torch
from torch import nn

from sapiens2.labels import COCO_KEYPOINT_NAMES
from sapiens2.pretrain.part_probes import (
    as_numpy,
    part_correspondence_accuracy,
    part_correspondence_chance,
    patch_image_identity,
    patch_part_labels,
)

FRONT, SIDE, BACK, UNDETERMINED = 0, 1, 2, -1
# (left, right) keypoint indices of the shoulders and of the hips.
TORSO_PAIRS = np.array([
    [COCO_KEYPOINT_NAMES.index(f"{side}_{joint}") for side in ("left", "right")]
    for joint in ("shoulder", "hip")
])

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
    kp = as_numpy(keypoints).astype(np.float64)
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
    feats, labels = as_numpy(feats), as_numpy(labels).astype(np.int64)
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
    train, query = as_numpy(train_labels), as_numpy(query_labels)
    train, query = train[train != -1], query[query != -1]
    if not len(train) or not len(query):
        raise ValueError(f"majority_accuracy: {len(train)} labelled train, {len(query)} query")
    classes, counts = np.unique(train, return_counts=True)
    return float(np.mean(query == classes[counts.argmax()]))


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
        return np.concatenate([as_numpy(batch[field]) for batch in batches])

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
        "patch_image_identity": patch_image_identity(val_patches, parts),
        "num_train_images": float(len(train_cls)),
        "num_val_images": float(len(val_cls)),
    }
