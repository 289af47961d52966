"""The reference release's dense layout: one folder per modality, files matched by name.

    rgb/<id>.png                 image
    mask/<id>.png                person mask (first channel > 0)
    normal/<id>.npy | .npz       (H, W, 3) camera-space unit normals (npz key "normal")
    depth/<id>.npy               (H, W) camera Z in metres
    camera_intrinsics/<id>.txt   3x3 K, pixel centres at integer coordinates
    camera_extrinsics/<id>.txt   4x4 world-to-camera (OpenCV)
    albedo/<id>.png              RGB albedo

The pointmap is the depth back-projected through K in the camera frame, as the reference builds
its targets, so the extrinsics are checked (4x4) but not applied. Our K puts pixel centres at
column + 0.5, so the reader adds 0.5 to cx, cy and the writer subtracts it. As in the reference,
NaN depth or normals take their pixels off the mask and non-unit normals are renormalised.
The writer stores identity extrinsics: our samples carry camera-frame geometry only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from sapiens2.data.formats.common import (check_sample, mask_bbox, read_rgb, require,
                                          unique_ids, write_png)
from sapiens2.data.npz import open_npz

DENSE_FIELDS = ("normal", "pointmap", "albedo")
_FOLDERS = {"normal": "normal", "pointmap": "depth", "albedo": "albedo"}
_PIXEL_CENTRE = np.array([[1, 0, 0.5], [0, 1, 0.5], [0, 0, 1]])


def _load_matrix(path: Path, field: str, shape: tuple[int, int]) -> np.ndarray:
    matrix = np.loadtxt(require(path, field))
    if matrix.shape != shape:
        raise ValueError(f"{path}: field {field!r} has shape {matrix.shape}, expected {shape}")
    return matrix


def _load_normal(folder: Path, stem: str) -> tuple[np.ndarray, Path]:
    npy, npz = folder / f"{stem}.npy", folder / f"{stem}.npz"
    if npy.is_file():
        return np.load(npy).astype(np.float32), npy
    with open_npz(require(npz, "normal")) as data:
        if "normal" not in data.files:
            raise ValueError(f"{npz}: missing field 'normal'")
        return data["normal"].astype(np.float32), npz


def back_project(depth: np.ndarray, K: np.ndarray) -> np.ndarray:
    """(H, W, 3) camera-space points of a Z-depth map; K uses pixel centres at column + 0.5."""
    rows, cols = np.mgrid[0 : depth.shape[0], 0 : depth.shape[1]]
    pixels = np.stack([cols + 0.5, rows + 0.5, np.ones_like(depth, np.float64)], -1)
    return (pixels @ np.linalg.inv(K).T * depth[..., None]).astype(np.float32)


def _read_one(root: Path, stem: str, fields: Sequence[str]) -> dict[str, Any]:
    image = read_rgb(root / "rgb" / f"{stem}.png")
    height, width = image.shape[:2]
    mask_path = require(root / "mask" / f"{stem}.png", "mask")
    mask_image = cv2.imread(str(mask_path), cv2.IMREAD_UNCHANGED)
    if mask_image is None:
        raise ValueError(f"{mask_path}: unreadable mask")
    mask = (mask_image[..., 0] if mask_image.ndim == 3 else mask_image) > 0
    sample: dict[str, Any] = {"id": stem, "image": image, "mask": mask}
    check_sample(sample, mask_path, 0, 0)
    if "normal" in fields:
        normal, path = _load_normal(root / "normal", stem)
        check_sample({"image": image, "normal": normal}, path, 0, 0)
        bad = np.isnan(normal).any(-1)
        normal[bad], mask = 0.0, mask & ~bad
        norms = np.linalg.norm(normal, axis=-1, keepdims=True)
        sample["normal"] = np.where(norms > 1e-6, normal / np.maximum(norms, 1e-6), 0.0)
    if "pointmap" in fields:
        depth_path = require(root / "depth" / f"{stem}.npy", "depth")
        depth = np.load(depth_path).astype(np.float64)
        if depth.shape != (height, width):
            raise ValueError(f"{depth_path}: field 'depth' has shape {depth.shape}, "
                             f"image needs {(height, width)}")
        K = _PIXEL_CENTRE @ _load_matrix(root / "camera_intrinsics" / f"{stem}.txt", "K", (3, 3))
        _load_matrix(root / "camera_extrinsics" / f"{stem}.txt", "extrinsics", (4, 4))
        bad = ~np.isfinite(depth)
        depth[bad], mask = 0.0, mask & ~bad
        sample["pointmap"] = back_project(depth, K)
        sample["K"] = K.astype(np.float32)
    if "albedo" in fields:
        albedo_path = root / "albedo" / f"{stem}.png"
        sample["albedo"] = read_rgb(albedo_path)
        check_sample({"image": image, "albedo": sample["albedo"]}, albedo_path, 0, 0)
    for field in ("normal", "pointmap"):
        if field in sample:
            sample[field] = np.where(mask[..., None], sample[field], 0).astype(np.float32)
    sample["mask"], sample["bbox"] = mask, mask_bbox(mask)
    check_sample(sample, root / "rgb" / f"{stem}.png", 0, 0)
    return sample


def read_dense(root: str | Path, fields: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
    """Samples of every rgb/*.png in name order; `fields` defaults to the modalities present."""
    root = Path(root)
    if not (root / "rgb").is_dir():
        raise ValueError(f"{root / 'rgb'}: missing image folder")
    if fields is None:
        fields = [f for f in DENSE_FIELDS if (root / _FOLDERS[f]).is_dir()]
    unknown = set(fields) - set(DENSE_FIELDS)
    if unknown:
        raise ValueError(f"unknown dense fields {sorted(unknown)}; expected {DENSE_FIELDS}")
    for path in sorted((root / "rgb").glob("*.png")):
        yield _read_one(root, path.stem, fields)


def write_dense(
    samples: Iterable[dict[str, Any]], output_dir: str | Path, normal_suffix: str = ".npy"
) -> int:
    """Write each sample's image, mask and the dense labels it has; returns the count."""
    output_dir, count = Path(output_dir), 0

    def path(folder: str, name: str) -> Path:
        (output_dir / folder).mkdir(parents=True, exist_ok=True)
        return output_dir / folder / name

    for sample in unique_ids(samples):
        stem = sample["id"]
        if "mask" not in sample:
            raise ValueError(f"sample {stem}: missing field 'mask' for the dense layout")
        write_png(output_dir / "rgb" / f"{stem}.png", sample["image"])
        write_png(output_dir / "mask" / f"{stem}.png", sample["mask"].astype(np.uint8) * 255)
        if "normal" in sample:
            normal = sample["normal"].astype(np.float32)
            if normal_suffix == ".npz":
                np.savez_compressed(path("normal", f"{stem}.npz"), normal=normal)
            else:
                np.save(path("normal", f"{stem}.npy"), normal)
        if "pointmap" in sample:
            if "K" not in sample:
                raise ValueError(f"sample {stem}: field 'pointmap' needs 'K' for the dense layout")
            np.save(path("depth", f"{stem}.npy"), sample["pointmap"][..., 2].astype(np.float32))
            K = np.linalg.inv(_PIXEL_CENTRE) @ sample["K"].astype(np.float64)
            np.savetxt(path("camera_intrinsics", f"{stem}.txt"), K, fmt="%.17g")
            np.savetxt(path("camera_extrinsics", f"{stem}.txt"), np.eye(4), fmt="%.17g")
        if "albedo" in sample:
            write_png(output_dir / "albedo" / f"{stem}.png", sample["albedo"])
        count += 1
    return count
