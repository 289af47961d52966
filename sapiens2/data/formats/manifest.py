"""Our own curated format, the one CuratedDataset trains on: `manifest.parquet` (one row per
image: id, path, status, split, ...), kept images under `images/` and labels as
`labels/<id>.npz` (keypoints, seg, mask, normal as float16, pointmap, albedo, K, bbox).

`write_manifest` is how data read from any other format becomes trainable; `read_manifest`
yields the labelled kept rows at their stored size, checked as the dataset checks them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sapiens2.data.dataset import load_curated_sample
from sapiens2.data.formats.common import unique_ids, write_png
from sapiens2.data.synth.sample_io import write_label_arrays
from sapiens2.labels import SEG_CLASSES

MANIFEST = "manifest.parquet"
LABEL_FIELDS = ("keypoints", "seg", "mask", "normal", "pointmap", "albedo", "K", "bbox")


def stored_labels(sample: dict[str, Any]) -> dict[str, np.ndarray]:
    """The label arrays of `sample` as our formats store them (normals as float16)."""
    labels = {k: sample[k] for k in LABEL_FIELDS if k in sample}
    if "normal" in labels:
        labels["normal"] = labels["normal"].astype(np.float16)
    return labels


def read_manifest(
    root: str | Path, split: str | None = None, fields: Sequence[str] | None = None,
    num_keypoints: int = 17, num_classes: int = len(SEG_CLASSES),
) -> Iterator[dict[str, Any]]:
    """Kept, labelled samples of `split` (all splits when None) in id order. fields=None yields
    every label array each file holds; otherwise each must be present."""
    root = Path(root)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{manifest_path}: missing manifest file")
    rows = pd.read_parquet(manifest_path)
    for column in ("id", "path", "status", "split"):
        if column not in rows.columns:
            raise ValueError(f"{manifest_path}: missing column {column!r}")
    rows = rows[rows["status"] == "kept"]
    if split is not None:
        rows = rows[rows["split"] == split]
    for row in rows.sort_values("id").itertuples():
        sample_id = str(row.id)
        if not (root / "labels" / f"{sample_id}.npz").is_file():
            continue  # kept for pretraining only: no task labels
        image_file = Path(row.path).name
        if not (root / "images" / image_file).is_file():
            raise ValueError(f"{manifest_path}: row {sample_id} field 'path' names missing file "
                             f"{root / 'images' / image_file}")
        yield load_curated_sample(root, sample_id, image_file, fields, num_keypoints, num_classes)


def write_manifest(
    samples: Iterable[dict[str, Any]],
    output_dir: str | Path,
    split: str | Mapping[str, str] = "train",
) -> int:
    """Write images (PNG), labels and manifest.parquet; `split` names one split for all samples
    or maps id -> split. Normals are stored as float16, as the generator stores them."""
    output_dir = Path(output_dir)
    (output_dir / "labels").mkdir(parents=True, exist_ok=True)
    rows = []
    for sample in unique_ids(samples):
        sample_id = str(sample["id"])
        path = f"images/{sample_id}.png"
        write_png(output_dir / path, sample["image"])
        write_label_arrays(output_dir / "labels" / f"{sample_id}.npz", stored_labels(sample))
        rows.append({
            "id": sample_id, "path": path, "source_path": path, "status": "kept", "reason": None,
            "split": split if isinstance(split, str) else split[sample_id], "has_labels": True,
        })
    pd.DataFrame(rows, columns=["id", "path", "source_path", "status", "reason", "split",
                                "has_labels"]).to_parquet(output_dir / MANIFEST, index=False)
    return len(rows)
