"""Loading a curated split's images into one uint8 array (small datasets that fit in memory)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image

from sapiens2.data.decode import read_rgb


def split_rows(curated_dir: str | Path, split: str) -> pd.DataFrame:
    """Kept manifest rows of `split` ("train" or "val"), sorted by id for a stable order."""
    manifest_path = Path(curated_dir) / "manifest.parquet"
    manifest = pd.read_parquet(manifest_path)
    for column in ("id", "status", "split"):
        if column not in manifest.columns:
            raise ValueError(f"{manifest_path}: missing column {column!r}")
    rows = manifest[(manifest["status"] == "kept") & (manifest["split"] == split)]
    if rows.empty:
        raise ValueError(f"{manifest_path}: no kept rows in split {split!r}")
    return rows.sort_values("id").reset_index(drop=True)


def kept_image_path(curated_dir: str | Path, row: pd.Series) -> Path:
    """Where curation copied a kept image: images/<id><original suffix>."""
    return Path(curated_dir) / "images" / f"{row['id']}{Path(row['path']).suffix}"


def load_split_images(curated_dir: str | Path, split: str, size: tuple[int, int]) -> tuple[np.ndarray, list[str]]:
    """All images of `split` as (N, H, W, 3) uint8 RGB resized to `size` (H, W), plus their ids."""
    rows = split_rows(curated_dir, split)
    height, width = size
    images = np.empty((len(rows), height, width, 3), dtype=np.uint8)
    for i, row in rows.iterrows():
        rgb = read_rgb(kept_image_path(curated_dir, row))
        if rgb.shape[:2] != (height, width):
            rgb = np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling.BILINEAR))
        images[i] = rgb
    return images, rows["id"].tolist()
