"""Export a curated data set (e.g. the synthetic generator's, after curation) to another format,
so the same labels can feed tools that read COCO, PNG label maps or the reference dense layout.
"""

from __future__ import annotations

from pathlib import Path

from sapiens2.data.formats import WRITERS, read_manifest


def export_curated(
    curated_dir: str | Path, fmt: str, output_dir: str | Path, split: str | None = None
) -> int:
    """Write the labelled kept samples of `split` (all when None) as `fmt`; returns the count.

    Samples lacking what a format needs (e.g. no seg map for "seglabels") fail with their id.
    """
    if fmt not in WRITERS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(WRITERS)}")
    return WRITERS[fmt](read_manifest(curated_dir, split), output_dir)
