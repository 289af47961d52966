"""Cluster-balanced sampling after Vo et al. 2024 ("Automatic data curation for self-supervised
learning: a clustering-based approach").

Web pools are long-tailed: a few looks (studio portraits, one sport) crowd out the rest. Leaf
clusters come from k-means on the embeddings and top clusters from k-means on the leaf
centroids (the hierarchy keeps a dense region from claiming many leaves and so many quotas).
The target size is split evenly over top clusters, then over each one's leaves, capped by what
a cluster holds with the surplus passed on (water-filling), and each leaf keeps a seeded random
sample of its members.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import faiss
import numpy as np

from sapiens2.curation.config import BalanceConfig


@dataclass(frozen=True)
class Clusters:
    """Per item its leaf cluster; per leaf its top cluster."""

    leaf: np.ndarray
    top_of_leaf: np.ndarray

    @property
    def top(self) -> np.ndarray:
        return self.top_of_leaf[self.leaf]


def _kmeans(x: np.ndarray, k: int, config: BalanceConfig) -> tuple[np.ndarray, np.ndarray]:
    """(centroids, assignment) of faiss k-means; k is clipped to the number of points."""
    k = max(1, min(k, len(x)))
    if k == 1:
        return x.mean(axis=0, keepdims=True), np.zeros(len(x), np.int64)
    km = faiss.Kmeans(x.shape[1], k, niter=config.niter, nredo=config.restarts, seed=config.seed, spherical=True,
                      min_points_per_centroid=1, max_points_per_centroid=1 << 20, verbose=False)
    km.train(np.ascontiguousarray(x, dtype=np.float32))
    _, assignment = km.index.search(np.ascontiguousarray(x, dtype=np.float32), 1)
    return km.centroids, assignment.ravel().astype(np.int64)


def _relabel(labels: np.ndarray) -> np.ndarray:
    """Number clusters by their first member, so ids do not depend on faiss's centroid order."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse.ravel()]


def hierarchical_clusters(embeddings: np.ndarray, config: BalanceConfig) -> Clusters:
    """Leaf k-means on the embeddings, then k-means of the leaf centroids into top clusters."""
    if len(embeddings) == 0:
        return Clusters(np.zeros(0, np.int64), np.zeros(0, np.int64))
    _, leaf = _kmeans(embeddings, config.clusters, config)
    leaf = _relabel(leaf)
    centroids = np.stack([embeddings[leaf == c].mean(axis=0) for c in range(leaf.max() + 1)])
    _, top = _kmeans(centroids, config.top_clusters, config)
    return Clusters(leaf, _relabel(top))


def water_fill(sizes: Sequence[int], target: int) -> list[int]:
    """Split ``target`` as evenly as possible over groups, none above its size.

    Small groups keep everything and their unused share goes to the others; leftover units
    after an even split go to the lowest-indexed open groups, so the result is deterministic.
    """
    quota = [0] * len(sizes)
    remaining = min(target, sum(sizes))
    open_groups = [g for g, size in enumerate(sizes) if size > 0]
    while remaining > 0 and open_groups:
        share, extra = divmod(remaining, len(open_groups))
        for rank, g in enumerate(open_groups):
            give = min(sizes[g] - quota[g], share + (rank < extra))
            quota[g] += give
            remaining -= give
        open_groups = [g for g in open_groups if quota[g] < sizes[g]]
    return quota


def _sample_key(item_id: str, seed: int) -> bytes:
    return hashlib.sha256(f"{seed}:{item_id}".encode()).digest()


def balanced_sample(ids: Sequence[str], clusters: Clusters, target: int, seed: int = 0) -> np.ndarray:
    """Boolean mask of the items kept: ``target`` of them (or all, if fewer), balanced by cluster."""
    keep = np.zeros(len(ids), bool)
    n_leaf = len(clusters.top_of_leaf)
    leaf_sizes = np.bincount(clusters.leaf, minlength=n_leaf)
    tops = sorted(set(clusters.top_of_leaf.tolist()))
    top_sizes = [int(leaf_sizes[clusters.top_of_leaf == t].sum()) for t in tops]
    for t, top_quota in zip(tops, water_fill(top_sizes, target)):
        leaves = np.flatnonzero(clusters.top_of_leaf == t)
        for leaf, quota in zip(leaves, water_fill([int(leaf_sizes[c]) for c in leaves], top_quota)):
            members = np.flatnonzero(clusters.leaf == leaf)
            order = sorted(members.tolist(), key=lambda i: _sample_key(ids[i], seed))
            keep[order[:quota]] = True
    return keep
