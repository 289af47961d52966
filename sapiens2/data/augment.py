"""Per-task training augmentation: flip, scale/crop, rotation, photometric distortion.

Each geometric transform moves the image and every label together, so a sample stays a valid
sample of every task it carries:

- Flip: x -> W - x (pixel centres at column + 0.5), left/right keypoints and Left_/Right_ part
  classes swap, normals and pointmaps negate X, the principal point mirrors.
- Scale/crop and rotation: one affine warp about the image centre plus a random shift (the crop
  window of a zoom-in, the placement of a zoom-out), output the same size. It acts as a camera
  zoom + roll about the optical axis, so normals and pointmaps rotate in-plane by the same
  rotation (Z unchanged) and K becomes M K R^T, which still projects the pointmap onto the
  image. The image is resampled bilinearly; label maps take the nearest pixel (classes stay
  valid, normals stay unit, the person never blends with the zero background). Keypoints move
  with the warp; those leaving the image get visibility 0. bbox is re-measured from the mask.
- Photometric distortion touches the image only; albedo targets never change. Rule for albedo:
  when a sample carries an albedo target, the image gets only a global brightness gain (a
  brighter or dimmer light leaves every surface's albedo as it is); contrast, saturation and hue
  shifts change apparent surface colour and would contradict the target, so they are skipped.

All randomness comes from the generator passed in, so (seed, epoch, index) fixes the result.
With the defaults only the flip is active and it consumes one draw, as the dataset did before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from sapiens2.labels import COCO_FLIP_PAIRS, SEG_FLIP

MAP_FIELDS = ("seg", "mask", "normal", "pointmap", "albedo")
_GRAY = np.array([0.299, 0.587, 0.114], np.float32)


def hflip_sample(
    sample: dict[str, Any], flip_pairs: Sequence[tuple[int, int]], seg_flip: Sequence[int]
) -> dict[str, Any]:
    """Mirror a sample left-right, keeping every label consistent with the mirrored image.

    x -> W - x (pixel centres at column + 0.5), left/right keypoints and part classes swap,
    normals and pointmaps negate X (the scene mirrored about the camera's X = 0 plane), and
    the principal point mirrors, cx -> W - cx, so K still projects the pointmap onto the image.
    """
    width = sample["image"].shape[1]
    out = {
        k: (np.ascontiguousarray(v[:, ::-1]) if k in MAP_FIELDS or k == "image" else v)
        for k, v in sample.items()
    }
    if "keypoints" in sample:
        kpts = sample["keypoints"].copy()
        kpts[:, 0] = width - kpts[:, 0]
        for left, right in flip_pairs:
            kpts[[left, right]] = kpts[[right, left]]
        out["keypoints"] = kpts
    if "seg" in sample:
        lut = np.arange(256, dtype=np.uint8)
        lut[: len(seg_flip)] = seg_flip
        out["seg"] = lut[out["seg"]]
    for field in ("normal", "pointmap"):
        if field in sample:
            out[field] = out[field].copy()
            out[field][..., 0] = -out[field][..., 0]
    if "K" in sample:
        out["K"] = sample["K"].copy()
        out["K"][0, 2] = width - sample["K"][0, 2]
    if "bbox" in sample:
        x0, y0, x1, y1 = sample["bbox"]
        out["bbox"] = np.array([width - x1, y0, width - x0, y1], np.float32)
    return out


def mask_bbox(mask: np.ndarray) -> np.ndarray:
    """x0, y0, x1, y1 of the mask's pixels in continuous coordinates (zeros when empty)."""
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    if len(rows) == 0:
        return np.zeros(4, np.float32)
    return np.array([cols[0], rows[0], cols[-1] + 1, rows[-1] + 1], np.float32)


def person_crop(sample: dict[str, Any], padding: float = 1.25) -> dict[str, Any]:
    """Top-down input: zoom so the person box, padded by `padding` and widened or heightened to
    the image's aspect, fills the frame centred on the box (the crop of a person detector's box).

    Labels move with the image (`affine_sample`), so a metric in crop coordinates is the metric
    of the original image scaled uniformly: OKS, with the box area re-measured, is unchanged.
    """
    height, width = sample["image"].shape[:2]
    x0, y0, x1, y1 = (float(v) for v in sample["bbox"])
    if x1 <= x0 or y1 <= y0:
        return sample  # no person box: the whole image is the crop
    crop_height = padding * max(y1 - y0, (x1 - x0) * height / width)
    scale = height / crop_height
    centre = np.array([width / 2, height / 2])
    offset = np.array([(x0 + x1) / 2, (y0 + y1) / 2]) - centre
    return affine_sample(sample, scale, 0.0, tuple(-scale * offset))


def affine_sample(
    sample: dict[str, Any], scale: float, angle_deg: float, shift: tuple[float, float]
) -> dict[str, Any]:
    """Zoom by `scale` and roll by `angle_deg` about the image centre, then shift (pixels).

    Positive angles turn the picture clockwise on screen (x right, y down).
    """
    height, width = sample["image"].shape[:2]
    theta = math.radians(angle_deg)
    rot = np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    lin = scale * rot
    centre = np.array([width / 2, height / 2])
    t = centre - lin @ centre + np.asarray(shift, np.float64)
    # OpenCV samples at integer pixel centres; ours sit at +0.5.
    cv_matrix = np.hstack([lin, (lin @ [0.5, 0.5] + t - 0.5)[:, None]])
    out = dict(sample)
    out["image"] = cv2.warpAffine(
        sample["image"], cv_matrix, (width, height), flags=cv2.INTER_LINEAR,
        borderMode=cv2.BORDER_CONSTANT, borderValue=0,
    )
    for field in MAP_FIELDS:
        if field in sample:
            dtype = sample[field].dtype
            src = sample[field].astype(np.float32 if dtype in (bool, np.float16) else dtype)
            warped = cv2.warpAffine(
                src, cv_matrix, (width, height), flags=cv2.INTER_NEAREST,
                borderMode=cv2.BORDER_CONSTANT, borderValue=0,
            )
            out[field] = warped.astype(dtype)
    for field in ("normal", "pointmap"):
        if field in out:
            vectors = out[field].astype(np.float32)
            vectors[..., :2] = vectors[..., :2] @ rot.T.astype(np.float32)
            out[field] = vectors.astype(sample[field].dtype)
    if "K" in sample:
        warp3, roll3 = np.eye(3), np.eye(3)
        warp3[:2, :2], warp3[:2, 2], roll3[:2, :2] = lin, t, rot
        out["K"] = (warp3 @ sample["K"].astype(np.float64) @ roll3.T).astype(np.float32)
    if "keypoints" in sample:
        kpts = sample["keypoints"].copy()
        kpts[:, :2] = kpts[:, :2] @ lin.T.astype(np.float32) + t.astype(np.float32)
        x, y = kpts[:, 0], kpts[:, 1]
        kpts[(x < 0) | (x >= width) | (y < 0) | (y >= height), 2] = 0
        out["keypoints"] = kpts
    if "bbox" in sample:
        if "mask" in out:
            out["bbox"] = mask_bbox(out["mask"])
        else:
            x0, y0, x1, y1 = sample["bbox"]
            corners = np.array([[x0, y0], [x1, y0], [x0, y1], [x1, y1]]) @ lin.T + t
            lo = np.clip(corners.min(0), 0, [width, height])
            hi = np.clip(corners.max(0), 0, [width, height])
            out["bbox"] = np.concatenate([lo, hi]).astype(np.float32)
    return out


def photometric(
    image: np.ndarray, rng: np.random.Generator, brightness: float, contrast: float,
    saturation: float, hue_deg: float, albedo_safe: bool,
) -> np.ndarray:
    """Random brightness gain, then (unless `albedo_safe`) contrast, saturation and hue."""
    x = image.astype(np.float32) * rng.uniform(1 - brightness, 1 + brightness)
    if not albedo_safe:
        mean = float((x @ _GRAY).mean())
        x = (x - mean) * rng.uniform(1 - contrast, 1 + contrast) + mean
        gray = (x @ _GRAY)[..., None]
        x = gray + (x - gray) * rng.uniform(1 - saturation, 1 + saturation)
        hsv = cv2.cvtColor(np.clip(x, 0, 255).round().astype(np.uint8), cv2.COLOR_RGB2HSV)
        shift = int(round(rng.uniform(-hue_deg, hue_deg) / 2))  # OpenCV hue runs 0..179
        hsv[..., 0] = ((hsv[..., 0].astype(np.int32) + shift) % 180).astype(np.uint8)
        return cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)
    return np.clip(x, 0, 255).round().astype(np.uint8)


@dataclass(frozen=True)
class Augment:
    """The augmentation recipe; `augment(sample, rng)` returns a new sample.

    Each stage runs with its probability: flip, then the affine (scale in `scale_range`,
    rotation in +-`max_rotation_deg`, shift up to the crop/pad margin), then photometric
    distortion (brightness gain in 1 +- `brightness`, contrast and saturation factors in
    1 +- their value, hue shift in +-`hue_deg`). Defaults: flip only.
    """

    hflip_prob: float = 0.5
    affine_prob: float = 0.0
    scale_range: tuple[float, float] = (0.75, 1.25)
    max_rotation_deg: float = 30.0
    photometric_prob: float = 0.0
    brightness: float = 0.25
    contrast: float = 0.25
    saturation: float = 0.25
    hue_deg: float = 10.0
    flip_pairs: tuple[tuple[int, int], ...] = COCO_FLIP_PAIRS
    seg_flip: tuple[int, ...] = SEG_FLIP

    def __post_init__(self) -> None:
        for name in ("hflip_prob", "affine_prob", "photometric_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"Augment.{name} = {getattr(self, name)} is not in [0, 1]")
        low, high = self.scale_range
        if not 0 < low <= high:
            raise ValueError(f"Augment.scale_range {self.scale_range} needs 0 < low <= high")
        for name in ("brightness", "contrast", "saturation"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"Augment.{name} = {getattr(self, name)} is not in [0, 1)")
        if self.max_rotation_deg < 0 or self.hue_deg < 0:
            raise ValueError("Augment.max_rotation_deg and hue_deg must be >= 0")

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        if self.hflip_prob > 0 and rng.random() < self.hflip_prob:
            sample = hflip_sample(sample, self.flip_pairs, self.seg_flip)
        if self.affine_prob > 0 and rng.random() < self.affine_prob:
            height, width = sample["image"].shape[:2]
            scale = rng.uniform(*self.scale_range)
            angle = rng.uniform(-self.max_rotation_deg, self.max_rotation_deg)
            margin = abs(scale - 1) * np.array([width, height]) / 2
            sample = affine_sample(sample, scale, angle, tuple(rng.uniform(-margin, margin)))
        if self.photometric_prob > 0 and rng.random() < self.photometric_prob:
            image = photometric(
                sample["image"], rng, self.brightness, self.contrast, self.saturation,
                self.hue_deg, albedo_safe="albedo" in sample,
            )
            sample = dict(sample, image=image)
        return sample
