"""Body-part segmentation: 29-class deconv head, CE + Dice, confusion-matrix metric, overlay."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import cv2
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from sapiens2.tasks.base import SummedStateMetric, Task, weighted_items
from sapiens2.labels import IGNORE_INDEX, SEG_CLASSES
from sapiens2.tasks.heads import SEG_WIDTHS, build_deconv_head
from sapiens2.tasks.losses import softmax_dice_loss


def _palette(n: int) -> np.ndarray:
    """Distinct colours (golden-ratio hues), background black."""
    hues = (np.arange(n) * 0.618034 % 1.0 * 180).astype(np.uint8)
    hsv = np.stack([hues, np.full(n, 200, np.uint8), np.full(n, 255, np.uint8)], -1)[None]
    colors = cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)[0]
    colors[0] = 0
    return colors


@dataclass(frozen=True)
class SegTask(Task):
    """Per-pixel class logits at 16x the token grid (full image resolution).

    class_weights scale the cross-entropy per class (uniform by default; the reference recipe
    passes its own weights through this field). `class_weighting: inverse_sqrt_frequency`
    derives them from the training labels instead (`with_label_statistics`): the most frequent
    class gets 1, a class k times rarer sqrt(k), capped at `max_class_weight`.
    """

    name: ClassVar[str] = "seg"
    primary_metric: ClassVar[str] = "mIoU"
    higher_is_better: ClassVar[bool] = True

    class_names: tuple[str, ...] = SEG_CLASSES
    class_weights: tuple[float, ...] | None = None
    class_weighting: Literal["inverse_sqrt_frequency"] | None = None
    max_class_weight: float = 10.0
    ce_weight: float = 1.0
    dice_weight: float = 1.0
    overlay_alpha: float = 0.5

    def __post_init__(self) -> None:
        if self.class_weights is not None and len(self.class_weights) != self.num_classes:
            raise ValueError(
                f"class_weights has {len(self.class_weights)} values, need {self.num_classes}"
            )
        if self.class_weighting not in (None, "inverse_sqrt_frequency"):
            raise ValueError(f"class_weighting must be 'inverse_sqrt_frequency' or None, got {self.class_weighting!r}")
        if self.class_weighting is not None and self.class_weights is not None:
            raise ValueError("give class_weights or class_weighting, not both")
        if self.max_class_weight < 1.0:
            raise ValueError(f"max_class_weight must be >= 1, got {self.max_class_weight}")

    def with_label_statistics(self, samples: Iterable[dict[str, Any]]) -> SegTask:
        """With `class_weighting`, the task whose `class_weights` come from these samples' labels."""
        if self.class_weighting is None:
            return self
        counts = np.zeros(self.num_classes, np.int64)
        for sample in samples:
            labels = np.asarray(sample["seg"]).ravel()
            counts += np.bincount(labels[labels < self.num_classes], minlength=self.num_classes)
        weights = inverse_sqrt_frequency(counts, self.max_class_weight)
        return replace(self, class_weighting=None, class_weights=tuple(float(w) for w in weights))

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def build_head(self, embed_dim: int, scale: str) -> nn.Module:
        return build_deconv_head(embed_dim, SEG_WIDTHS, scale, self.num_classes, full_resolution=True)

    def loss(
        self, pred: torch.Tensor, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        target = batch["seg"].to(pred.device).long()
        weight = None if self.class_weights is None else pred.new_tensor(self.class_weights)
        ce = F.cross_entropy(pred, target, weight=weight, ignore_index=IGNORE_INDEX)
        dice = softmax_dice_loss(pred, target, IGNORE_INDEX, exclude=(0,))
        return weighted_items(
            {"cross_entropy": (self.ce_weight, ce), "dice": (self.dice_weight, dice)}
        )

    def decode(self, pred: torch.Tensor) -> list[np.ndarray]:
        """(H, W) uint8 class maps."""
        return list(pred.detach().argmax(dim=1).to(torch.uint8).cpu().numpy())

    def decode_labels(self, batch: dict[str, Any]) -> list[np.ndarray]:
        """(H, W) uint8 class maps; ignored pixels drawn as background."""
        seg = batch["seg"].detach().cpu().numpy()
        return list(np.where(seg == IGNORE_INDEX, 0, seg).astype(np.uint8))

    def metric(self) -> ConfusionMetric:
        return ConfusionMetric(self.class_names)

    def visualize(self, image_uint8: np.ndarray, output: np.ndarray) -> np.ndarray:
        colors = _palette(self.num_classes)[output]
        blended = (1 - self.overlay_alpha) * image_uint8 + self.overlay_alpha * colors
        # Background stays the untouched image so the person's parts stand out.
        blended = np.where(output[..., None] == 0, image_uint8, blended)
        return blended.round().astype(np.uint8)


def inverse_sqrt_frequency(counts: np.ndarray, max_weight: float) -> np.ndarray:
    """sqrt(most frequent count / count) per class, in [1, max_weight]; absent classes get the cap.

    Measured on the demo split (plain loop, 450 steps): mIoU 0.185 with a cap of 10 against
    0.169 unweighted; body parts are 20-70 pixels an image beside ~10,800 of background.
    """
    counts = np.asarray(counts, np.float64)
    if counts.max() <= 0:
        raise ValueError("no labelled pixels to weight the classes by")
    ratio = np.divide(counts.max(), counts, out=np.full_like(counts, np.inf), where=counts > 0)
    return np.clip(np.sqrt(ratio), 1.0, max_weight)


class ConfusionMetric(SummedStateMetric):
    """mIoU, mAcc and aAcc from a (C, C) confusion histogram (rows ground truth, cols prediction).

    Conventions (as MMSegmentation): pixels labelled 255 are ignored; mIoU averages the IoU of
    classes present in the ground truth or the prediction (union > 0); mAcc averages per-class
    recall over classes present in the ground truth; aAcc is overall pixel accuracy. All values
    are fractions in [0, 1]. Per-class IoU is reported as `IoU.<class>` for classes present.
    """

    def __init__(self, class_names: tuple[str, ...]) -> None:
        self.class_names = class_names
        super().__init__()

    def _empty_state(self) -> dict[str, np.ndarray]:
        n = len(self.class_names)
        return {"confusion": np.zeros((n, n), dtype=np.int64)}

    def update(self, pred: torch.Tensor, batch: dict[str, Any]) -> None:
        n = len(self.class_names)
        labels = batch["seg"].detach().cpu().long().reshape(-1)
        predicted = pred.detach().argmax(dim=1).cpu().reshape(-1)
        valid = (labels >= 0) & (labels < n)
        counts = torch.bincount(labels[valid] * n + predicted[valid], minlength=n * n)
        self.state["confusion"] += counts.reshape(n, n).numpy()

    def compute(self) -> dict[str, float]:
        conf = self.state["confusion"].astype(np.float64)
        tp = np.diag(conf)
        gt = conf.sum(axis=1)
        union = gt + conf.sum(axis=0) - tp
        if conf.sum() == 0:
            raise ValueError("ConfusionMetric.compute called with no labelled pixels")
        iou = np.divide(tp, union, out=np.full_like(tp, np.nan), where=union > 0)
        acc = np.divide(tp, gt, out=np.full_like(tp, np.nan), where=gt > 0)
        out = {
            "mIoU": float(np.nanmean(iou)),
            "mAcc": float(np.nanmean(acc)),
            "aAcc": float(tp.sum() / conf.sum()),
        }
        out.update(
            {
                f"IoU.{name}": float(v)
                for name, v in zip(self.class_names, iou, strict=True)
                if not np.isnan(v)
            }
        )
        return out
