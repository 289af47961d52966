"""Export a curated data set (e.g. the synthetic generator's, after curation) to another format,
so the same labels can feed tools that read COCO, PNG label maps or the reference dense layout.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from sapiens2.data.formats import WRITERS, read_manifest
from sapiens2.data.formats.manifest import MANIFEST

SPLIT_AWARE = ("manifest", "shards")  # formats that record each sample's split


def export_curated(
    curated_dir: str | Path, fmt: str, output_dir: str | Path, split: str | None = None
) -> int:
    """Write the labelled kept samples of `split` (all when None) as `fmt`; returns the count.

    Formats that record splits keep each sample's split from the manifest. Samples lacking
    what a format needs (e.g. no seg map for "seglabels") fail with their id.
    """
    if fmt not in WRITERS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(WRITERS)}")
    samples = read_manifest(curated_dir, split)
    if fmt in SPLIT_AWARE:
        rows = pd.read_parquet(Path(curated_dir) / MANIFEST, columns=["id", "split"])
        return WRITERS[fmt](samples, output_dir, split=dict(zip(rows["id"].astype(str), rows["split"])))
    return WRITERS[fmt](samples, output_dir)
