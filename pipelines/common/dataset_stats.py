"""Per-image label statistics and file counts of a curated dataset: the tables that the
great-expectations suites of `pipelines.validate` check.

Every statistic is a plain number per image so that a range expectation can gate it and a
failure names the image: keypoint counts and bounds, segmentation class range, normal unit
length, pointmap depth and reprojection error through K, albedo range, label/image shapes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sapiens2.data.npz import open_npz

TASKS = ("pose", "seg", "normal", "pointmap", "albedo")
NUM_KEYPOINTS = 17
NUM_SEG_CLASSES = 29


def _stats_pose(z, height: int, width: int) -> dict:
    kp = np.asarray(z["keypoints"], dtype=np.float64)
    vis = kp[:, 2]
    labelled = vis > 0  # 0 = outside the image, so only 1/2 must lie inside it
    x, y = kp[labelled, 0], kp[labelled, 1]
    outside = (x < 0) | (x > width) | (y < 0) | (y > height)
    return {
        "num_keypoints": int(kp.shape[0]),
        "num_visible": int((vis == 2).sum()),
        "num_invalid_vis": int((~np.isin(vis, (0.0, 1.0, 2.0))).sum()),
        "num_out_of_bounds": int(outside.sum()),
    }


def _stats_seg(z, height: int, width: int) -> dict:
    seg, mask = z["seg"], z["mask"].astype(bool)
    return {
        "class_min": int(seg.min()),
        "class_max": int(seg.max()),
        "shape_matches": seg.shape == (height, width),
        "mask_agreement": float(((seg > 0) == mask).mean()) if seg.shape == mask.shape else 0.0,
    }


def _stats_normal(z, height: int, width: int) -> dict:
    normal, mask = z["normal"].astype(np.float32), z["mask"].astype(bool)
    norm_err = np.abs(np.linalg.norm(normal[mask], axis=-1) - 1.0)
    return {
        "max_norm_error": float(norm_err.max()) if norm_err.size else 0.0,
        "nonzero_outside_mask": int(np.any(normal[~mask] != 0, axis=-1).sum()),
        "num_nonfinite": int((~np.isfinite(normal)).sum()),
        "shape_matches": normal.shape == (height, width, 3),
    }


def _stats_pointmap(z, height: int, width: int) -> dict:
    points, mask, intr = z["pointmap"].astype(np.float64), z["mask"].astype(bool), z["K"]
    rows, cols = np.nonzero(mask)
    xyz = points[rows, cols]
    proj = xyz @ np.asarray(intr, dtype=np.float64).T
    with np.errstate(divide="ignore", invalid="ignore"):
        uv = proj[:, :2] / proj[:, 2:3]
    # Pixel centres sit at (column + 0.5, row + 0.5), the synthetic generator's convention.
    err = np.linalg.norm(uv - np.stack([cols + 0.5, rows + 0.5], axis=1), axis=1)
    return {
        "z_min": float(xyz[:, 2].min()) if len(xyz) else np.nan,
        "z_max": float(xyz[:, 2].max()) if len(xyz) else np.nan,
        "median_reprojection_px": float(np.median(err)) if len(err) else np.nan,
        "nonzero_outside_mask": int(np.any(points[~mask] != 0, axis=-1).sum()),
        "shape_matches": points.shape == (height, width, 3),
    }


def _stats_albedo(z, height: int, width: int) -> dict:
    albedo = z["albedo"]
    return {
        "albedo_min": int(albedo.min()),
        "albedo_max": int(albedo.max()),
        "shape_matches": albedo.shape == (height, width, 3),
    }


_STATS = {"pose": _stats_pose, "seg": _stats_seg, "normal": _stats_normal,
          "pointmap": _stats_pointmap, "albedo": _stats_albedo}


def build_label_manifests(curated_dir: str | Path) -> dict[str, pd.DataFrame]:
    """Summarise every kept image's labels into one statistics table per task.

    Reads the kept rows of `manifest.parquet` and their `labels/<id>.npz`; image size comes
    from the manifest's width/height. Kept rows without a label file get no row (the count
    suite reports them).
    """
    curated_dir = Path(curated_dir)
    manifest = pd.read_parquet(curated_dir / "manifest.parquet")
    rows: dict[str, list[dict]] = {task: [] for task in TASKS}
    for rec in manifest[manifest["status"] == "kept"].itertuples(index=False):
        label_path = curated_dir / "labels" / f"{rec.id}.npz"
        if not label_path.is_file():
            continue
        try:
            with open_npz(label_path) as z:
                for task in TASKS:
                    stats = _STATS[task](z, int(rec.height), int(rec.width))
                    rows[task].append({"id": str(rec.id), **stats})
        except (KeyError, ValueError, OSError) as exc:
            raise ValueError(f"unreadable label file {label_path}: {exc}") from exc
    return {task: pd.DataFrame(rows[task]) for task in TASKS}


def write_label_manifests(curated_dir: str | Path) -> dict[str, pd.DataFrame]:
    """`build_label_manifests`, each table also written as `labels/<task>.parquet` (the curation
    step's output; validation only reads)."""
    tables = build_label_manifests(curated_dir)
    labels = Path(curated_dir) / "labels"
    if labels.is_dir():
        for task, table in tables.items():
            table.to_parquet(labels / f"{task}.parquet", index=False)
    return tables


def _count_files(folder: Path, suffixes: tuple[str, ...] | None = None) -> int:
    if not folder.is_dir():
        return 0
    return sum(1 for p in folder.iterdir() if p.is_file() and (suffixes is None or p.suffix in suffixes))


def build_counts(curated_dir: str | Path, input_count: int | None = None) -> pd.DataFrame:
    """One-row table of manifest status counts next to the files actually on disk.

    `label_files` is null when the dataset has no labels/ folder, `input_count` when the
    caller does not know how many files went into curation; those comparisons are skipped.
    """
    curated_dir = Path(curated_dir)
    status = pd.read_parquet(curated_dir / "manifest.parquet", columns=["status"])["status"]
    has_labels = (curated_dir / "labels").is_dir()
    return pd.DataFrame([{
        "manifest_rows": len(status),
        "kept_rows": int((status == "kept").sum()),
        "rejected_rows": int((status == "rejected").sum()),
        "quarantined_rows": int((status == "quarantined").sum()),
        "image_files": _count_files(curated_dir / "images"),
        "label_files": _count_files(curated_dir / "labels", (".npz",)) if has_labels else None,
        "input_count": input_count,
    }], dtype="Int64")
