"""Curated, labelled images as training/evaluation batches for the five tasks.

`CuratedDataset` reads the kept rows of one split from `curated_dir/manifest.parquet`, the
image from `curated_dir/images/` and its labels from `curated_dir/labels/<id>.npz`; `collate`
stacks samples into the batch dict every task's loss and metric take. Labels are validated on
read so a bad file fails with its path and field instead of deep inside a loss.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from sapiens2.data.augment import Augment, hflip_sample, person_crop  # noqa: F401 (re-exported)
from sapiens2.data.decode import read_rgb
from sapiens2.data.npz import open_npz
from sapiens2.data.normalize import IMAGE_MEAN, IMAGE_STD, normalize_images  # noqa: F401 (re-exported)
from sapiens2.labels import COCO_FLIP_PAIRS, IGNORE_INDEX, SEG_FLIP, TASK_NAMES


# Label arrays each task needs; mask, K and bbox are always read (small, shared by several).
TASK_FIELDS = {
    "pose": ("keypoints",),
    "seg": ("seg",),
    "normal": ("normal",),
    "pointmap": ("pointmap",),
    "albedo": ("albedo",),
}
COMMON_FIELDS = ("mask", "K", "bbox")
MAP_CHANNELS = {"seg": None, "mask": None, "normal": 3, "pointmap": 3, "albedo": 3}


def validate_labels(
    labels: dict[str, np.ndarray],
    height: int,
    width: int,
    num_keypoints: int,
    num_classes: int,
    path: str,
) -> None:
    """Raise ValueError naming the file and field for a wrong shape or out-of-range value."""

    def fail(field: str, why: str) -> None:
        raise ValueError(f"{path}: field {field!r} {why}")

    for field, channels in MAP_CHANNELS.items():
        if field in labels:
            expected = (height, width) if channels is None else (height, width, channels)
            if labels[field].shape != expected:
                fail(field, f"has shape {labels[field].shape}, image needs {expected}")
    if "keypoints" in labels and labels["keypoints"].shape != (num_keypoints, 3):
        fail("keypoints", f"has shape {labels['keypoints'].shape}, expected ({num_keypoints}, 3)")
    if "seg" in labels:
        ids = np.unique(labels["seg"])
        bad = ids[(ids >= num_classes) & (ids != IGNORE_INDEX)]
        if bad.size:
            fail(
                "seg",
                f"has class ids {bad.tolist()} outside 0..{num_classes - 1} (or {IGNORE_INDEX})",
            )
    if "K" in labels and labels["K"].shape != (3, 3):
        fail("K", f"has shape {labels['K'].shape}, expected (3, 3)")
    if "bbox" in labels and labels["bbox"].shape != (4,):
        fail("bbox", f"has shape {labels['bbox'].shape}, expected (4,)")


def resize_sample(sample: dict[str, Any], height: int, width: int) -> dict[str, Any]:
    """Resize image and labels together; coordinates scale with the pixel grid."""
    h0, w0 = sample["image"].shape[:2]
    sx, sy = width / w0, height / h0
    out = dict(
        sample, image=cv2.resize(sample["image"], (width, height), interpolation=cv2.INTER_AREA)
    )
    for field in MAP_CHANNELS:
        if field in sample:
            # Nearest keeps labels discrete and never blends the person with the zero background.
            dtype = sample[field].dtype
            resized = cv2.resize(
                sample[field].astype(np.float32 if dtype in (bool, np.float16) else dtype),
                (width, height),
                interpolation=cv2.INTER_NEAREST_EXACT,
            )
            out[field] = resized.astype(dtype)
    if "keypoints" in sample:
        out["keypoints"] = sample["keypoints"] * np.array([sx, sy, 1], np.float32)
    if "K" in sample:
        out["K"] = np.diag([sx, sy, 1]).astype(np.float32) @ sample["K"]
    if "bbox" in sample:
        out["bbox"] = sample["bbox"] * np.array([sx, sy, sx, sy], np.float32)
    return out


def load_curated_sample(
    root: Path,
    sample_id: str,
    image_file: str,
    fields: Sequence[str] | None,
    num_keypoints: int,
    num_classes: int,
) -> dict[str, Any]:
    """One curated image (RGB) and its validated labels at their stored size.

    fields=None reads every array of the label file; otherwise each named field must be there.
    """
    image = read_rgb(root / "images" / image_file)
    label_path = root / "labels" / f"{sample_id}.npz"
    if not label_path.is_file():
        raise ValueError(f"{label_path}: missing label file for image {image_file}")
    with open_npz(label_path) as npz:
        return labelled_sample(
            sample_id, image, npz, fields, num_keypoints,
            num_classes, str(label_path),
        )


def labelled_sample(
    sample_id: str,
    image: np.ndarray,
    npz: np.lib.npyio.NpzFile,
    fields: Sequence[str] | None,
    num_keypoints: int,
    num_classes: int,
    where: str,
) -> dict[str, Any]:
    """The sample dict of an RGB image and the label arrays of `npz`, validated against it.

    fields=None takes every array; otherwise each named field must be there. Errors start
    with `where`.
    """
    wanted = list(npz.files if fields is None else fields)
    absent = [f for f in wanted if f not in npz.files]
    if absent:
        raise ValueError(f"{where}: missing field(s) {absent}")
    labels = {f: npz[f] for f in wanted}
    height, width = image.shape[:2]
    validate_labels(labels, height, width, num_keypoints, num_classes, where)
    return {"id": sample_id, "image": image, **labels}


class CuratedDataset(Dataset):
    """Kept images of one split with the labels of the requested tasks.

    hflip_prob defaults to 0.5 for the "train" split and 0 otherwise. `augment` replaces that
    flip-only default with a full recipe (`sapiens2.data.augment.Augment`: flip, scale/crop,
    rotation, photometric); give one or the other. Augmentation depends only on
    (seed, epoch, index), so runs and resumed runs see the same samples; call `set_epoch` each
    epoch. `person_crop_padding` makes every sample a top-down person crop (`person_crop`), as
    pose models see them; `label_fraction` keeps a seeded share of the split's labelled images
    (fine-tuning with fewer labels than pretraining saw images).
    """

    def __init__(
        self,
        curated_dir: str | os.PathLike,
        split: str,
        height: int = 128,
        width: int = 96,
        tasks: Sequence[str] = TASK_NAMES,
        hflip_prob: float | None = None,
        flip_pairs: Sequence[tuple[int, int]] = COCO_FLIP_PAIRS,
        seg_flip: Sequence[int] = SEG_FLIP,
        num_keypoints: int = 17,
        seed: int = 0,
        augment: Augment | None = None,
        person_crop_padding: float | None = None,
        label_fraction: float = 1.0,
    ) -> None:
        unknown = set(tasks) - set(TASK_NAMES)
        if unknown:
            raise ValueError(f"unknown tasks {sorted(unknown)}; expected a subset of {TASK_NAMES}")
        self.root = Path(curated_dir)
        manifest = pd.read_parquet(self.root / "manifest.parquet")
        rows = manifest[(manifest["status"] == "kept") & (manifest["split"] == split)]
        self.ids = sorted(str(i) for i in rows["id"])
        if tasks:
            # Curation keeps images for pretraining whether or not they carry task labels
            # (near-duplicates re-framed by the generator, real photos); tasks use labelled ones.
            self.ids = [i for i in self.ids if (self.root / "labels" / f"{i}.npz").is_file()]
        if not self.ids:
            raise ValueError(f"{self.root / 'manifest.parquet'}: no kept rows in split {split!r}")
        if not 0.0 < label_fraction <= 1.0:
            raise ValueError(f"label_fraction must lie in (0, 1], got {label_fraction}")
        if label_fraction < 1.0:
            # A seeded subset, sorted again, so a smaller fraction keeps a subset of a larger one.
            order = np.random.default_rng(seed).permutation(len(self.ids))
            keep = order[: max(1, round(label_fraction * len(self.ids)))]
            self.ids = [self.ids[i] for i in sorted(keep)]
        files = {Path(name).stem: name for name in os.listdir(self.root / "images")}
        missing = [i for i in self.ids if i not in files]
        if missing:
            raise ValueError(f"{self.root / 'images'}: no image for kept ids {missing[:5]}")
        self.image_files = [files[i] for i in self.ids]
        self.height, self.width = height, width
        self.fields = COMMON_FIELDS + tuple(f for t in tasks for f in TASK_FIELDS[t])
        if augment is not None and hflip_prob is not None:
            raise ValueError("give CuratedDataset either hflip_prob or augment, not both")
        if augment is None:
            default_prob = 0.5 if split == "train" else 0.0
            augment = Augment(
                hflip_prob=default_prob if hflip_prob is None else hflip_prob,
                flip_pairs=tuple(flip_pairs),
                seg_flip=tuple(seg_flip),
            )
        self.augment, self.hflip_prob = augment, augment.hflip_prob
        self.flip_pairs, self.seg_flip = augment.flip_pairs, augment.seg_flip
        self.num_keypoints, self.num_classes = num_keypoints, len(seg_flip)
        self.seed, self.epoch = seed, 0
        self.person_crop_padding = person_crop_padding
        # Decoded, resized samples by index: a training run revisits each image every epoch,
        # and decoding its PNG and label arrays cost more than the tiny models' step.
        self._decoded: dict[int, dict[str, Any]] = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index not in self._decoded:
            sample = load_curated_sample(
                self.root, self.ids[index], self.image_files[index], self.fields,
                self.num_keypoints, self.num_classes,
            )
            if sample["image"].shape[:2] != (self.height, self.width):
                sample = resize_sample(sample, self.height, self.width)
            if self.person_crop_padding is not None:
                sample = person_crop(sample, self.person_crop_padding)
            self._decoded[index] = sample
        # Copies: a caller writing into a sample (or an augmentation that returns it unchanged)
        # must not alter what the next epoch reads.
        sample = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in self._decoded[index].items()}
        return self.augment(sample, np.random.default_rng([self.seed, self.epoch, index]))


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack samples into the task batch: images normalised, maps channel-first float, seg long."""
    images = torch.from_numpy(np.stack([s["image"] for s in samples]))
    batch: dict[str, Any] = {
        "id": [s["id"] for s in samples],
        "image_uint8": images,
        "image": normalize_images(images),
    }

    def stack(field: str) -> torch.Tensor:
        return torch.from_numpy(np.stack([s[field] for s in samples]))

    for field in samples[0]:
        if field in ("keypoints", "K", "bbox"):
            batch[field] = stack(field).float()
        elif field == "seg":
            batch[field] = stack(field).long()
        elif field == "mask":
            batch[field] = stack(field).bool()
        elif field in ("normal", "pointmap"):
            batch[field] = stack(field).float().permute(0, 3, 1, 2).contiguous()
        elif field == "albedo":
            batch[field] = (stack(field).float() / 255.0).permute(0, 3, 1, 2).contiguous()
    return batch
