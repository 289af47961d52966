"""Global passes over the rows the filter chain kept: deduplication, then cluster balancing.

Both need every survivor at once, so they run in the main process after the per-file chain;
they edit the rows in place (status, reason, detail, ``dup_group``, ``cluster``, ``cluster_top``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from sapiens2.curation.balance import balanced_sample, hierarchical_clusters
from sapiens2.curation.config import CurationConfig
from sapiens2.curation.dedup import Keypoints, candidate_pairs, group_duplicates, similarity_inliers
from sapiens2.curation.embed import near_duplicate_pairs


def _priority(rows: list[dict[str, Any]], alive: list[int]) -> Callable[[int], tuple]:
    def priority(k: int) -> tuple:
        # A labelled copy beats a bigger unlabelled one (it serves the task heads too); then the
        # largest image; then the path, so equal copies resolve the same way on every run.
        row = rows[alive[k]]
        return (not row["has_labels"], -row["width"] * row["height"], row["source_path"])
    return priority


def deduplicate(rows: list[dict[str, Any]], config: CurationConfig,
                keypoints_of: Callable[[list[int]], list[Keypoints]]) -> None:
    """Mark all but one member of each duplicate group among the kept rows, in place.

    Three passes, each over the representatives the previous one left: exact content hash,
    perceptual hash (+ ORB verification), then embedding cosine when configured. Their edges
    form one graph, so a group found in several passes still has one representative.
    ``keypoints_of`` maps row indices to ORB keypoints (the caller decodes, maybe in a pool).
    """
    alive = [i for i, row in enumerate(rows) if row["status"] == "kept"]
    priority = _priority(rows, alive)
    edges: list[tuple[int, int, str]] = []
    by_hash: dict[str, list[int]] = {}
    for k, i in enumerate(alive):
        by_hash.setdefault(rows[i]["sha256"], []).append(k)
    for members in by_hash.values():
        rep = min(members, key=priority)
        edges.extend((rep, k, "identical sha256") for k in members if k != rep)
    survivors = sorted(min(members, key=priority) for members in by_hash.values())

    pairs = [(survivors[a], survivors[b], d)
             for a, b, d in candidate_pairs([rows[alive[k]]["phash"] for k in survivors], config.phash_hamming)]
    if config.dup_verify and pairs:
        involved = sorted({k for i, j, _ in pairs for k in (i, j)})
        keypoints = dict(zip(involved, keypoints_of([alive[k] for k in involved])))
        checked = [(i, j, d, similarity_inliers(keypoints[i], keypoints[j])) for i, j, d in pairs]
        edges += [(i, j, f"hamming {d}, {n} ORB inliers") for i, j, d, n in checked if n >= config.dup_min_inliers]
    else:
        edges += [(i, j, f"hamming {d}") for i, j, d in pairs]

    if config.embedding.near_dup_cosine is not None:
        groups = group_duplicates(len(alive), [(i, j) for i, j, _ in edges], priority)
        left = [k for k in range(len(alive)) if not groups.is_duplicate(k)]
        vectors = np.stack([rows[alive[k]]["_embedding"] for k in left]) if left else np.zeros((0, 1), np.float32)
        edges += [(left[a], left[b], f"embedding cosine {c:.3f}")
                  for a, b, c in near_duplicate_pairs(vectors, config.embedding.near_dup_cosine)]

    groups = group_duplicates(len(alive), [(i, j) for i, j, _ in edges], priority)
    evidence = {frozenset((i, j)): why for i, j, why in edges}
    for k, i in enumerate(alive):
        rep = groups.representative[k]
        if rep is None:
            continue
        rows[i]["dup_group"] = rows[alive[rep]]["id"]
        if rep != k:
            why = evidence.get(frozenset((k, rep)), "via other group members")
            rows[i] |= {"status": "rejected", "reason": "duplicate",
                        "detail": f"duplicate of {rows[alive[rep]]['id']} ({why})"}


def balance(rows: list[dict[str, Any]], config: CurationConfig) -> dict[str, list[int]] | None:
    """Cluster the kept rows and sample them down to ``balance.target_size``, in place.

    Returns the leaf-cluster sizes before and after sampling (None when balancing is off).
    """
    target = config.balance.target_size
    if target is None:
        return None
    alive = [i for i, row in enumerate(rows) if row["status"] == "kept"]
    vectors = np.stack([rows[i]["_embedding"] for i in alive]) if alive else np.zeros((0, 1), np.float32)
    clusters = hierarchical_clusters(vectors, config.balance)
    keep = balanced_sample([rows[i]["id"] for i in alive], clusters, target, config.balance.seed)
    for k, i in enumerate(alive):
        leaf, top = int(clusters.leaf[k]), int(clusters.top[k])
        rows[i] |= {"cluster": leaf, "cluster_top": top}
        if not keep[k]:
            rows[i] |= {"status": "rejected", "reason": "over_represented",
                        "detail": f"cluster {leaf} (top {top}) is over its share of target_size {target}"}
    n_leaf = len(clusters.top_of_leaf)
    return {"before": np.bincount(clusters.leaf, minlength=n_leaf).tolist(),
            "after": np.bincount(clusters.leaf[keep], minlength=n_leaf).tolist(),
            "top_of_leaf": clusters.top_of_leaf.tolist()}
