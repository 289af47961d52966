"""What a pretraining run hands on: probe the student and the EMA teacher, export the better one.

The choice is made on the train split alone (k-NN memory on every other image, queries and part
correspondence on the rest), so the held-out split that evaluation reports on never picks the
weights. The reported probes (train memory, val queries) run on every candidate and on the
randomly initialised backbone, the floor pretraining must beat.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from sapiens2.data.dataset import CuratedDataset, collate
from sapiens2.pretrain.probes import run_probes

PROBE_TASKS = ("pose", "seg")  # keypoints give the viewpoint, seg the body parts
DEFAULT_EXPORT = "teacher"  # without labelled images to probe with: DINO's choice


def probe_batches(curated_dir: Path, split: str, image_size: tuple[int, int], batch_size: int = 32) -> list[dict]:
    """The labelled images of a split as collated batches, unflipped."""
    data = CuratedDataset(curated_dir, split, *image_size, tasks=PROBE_TASKS, hflip_prob=0.0)
    return [collate([data[i] for i in range(s, min(s + batch_size, len(data)))])
            for s in range(0, len(data), batch_size)]


def interleaved_halves(batches: list[dict]) -> tuple[list[dict], list[dict]]:
    """Every other image of `batches` and the rest, as two lists of single-batch lists: both
    halves see every kind of image, and no image is decoded again."""
    halves: tuple[list[dict], list[dict]] = ([], [])
    for parity, half in enumerate(halves):
        picked = {k: (v[parity::2] if isinstance(v, (torch.Tensor, list)) else v)
                  for k, v in _concat(batches).items()}
        if len(picked["id"]):
            half.append(picked)
    return halves


def _concat(batches: list[dict]) -> dict:
    return {k: (torch.cat([b[k] for b in batches]) if isinstance(batches[0][k], torch.Tensor)
                else [x for b in batches for x in b[k]]) for k in batches[0]}


def selection_score(probes: dict[str, float]) -> float:
    """Both probes' gains over their floors, summed: global and dense features count alike."""
    return (probes["knn_viewpoint_acc"] - probes["viewpoint_majority_acc"]
            + probes["part_correspondence_acc"] - probes["part_correspondence_chance"])


def probe_and_choose(candidates: dict[str, nn.Module], random_backbone: nn.Module, curated_dir: Path,
                     image_size: tuple[int, int]) -> tuple[str, dict[str, dict[str, float]]]:
    """(name of the candidate to export, probe results per candidate and for "random").

    Each candidate's dict holds the held-out probes plus `selection_score` from the train halves.
    Without labelled train and val images nothing is probed and the teacher is exported.
    """
    try:
        train = probe_batches(curated_dir, "train", image_size)
        val = probe_batches(curated_dir, "val", image_size)
    except ValueError:
        # An unlabelled pool (a raw S3 prefix, a test folder) has nothing to probe with.
        return DEFAULT_EXPORT, {}
    memory, queries = interleaved_halves(train)
    if not queries:
        return DEFAULT_EXPORT, {}
    results: dict[str, dict[str, float]] = {}
    for name, backbone in candidates.items():
        held_out = run_probes(backbone, train, val)
        results[name] = held_out | {"selection_score": selection_score(run_probes(backbone, memory, queries))}
    results["random"] = run_probes(random_backbone, train, val)
    chosen = max(candidates, key=lambda name: results[name]["selection_score"])
    return chosen, results
