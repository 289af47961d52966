"""Trivial baselines: predictors that never look at the image (plus the identity for albedo).

A fine-tuned model's number means something only next to the best prediction that needs no
learning from pixels: the per-pixel class prior, one constant normal or albedo colour, the input
image as albedo, the mean canonical pointmap, the mean skeleton placed in the person box
(SAPIENS2_FACTS section 8). Each is fitted on the train split with `update`/`fit` and maps a
collated batch (`sapiens2.data.dataset.collate`) to a prediction in exactly the format the task's
metric takes, so `task.metric()` scores it like the model.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn import functional as F

from sapiens2.tasks.base import Task
from sapiens2.tasks.pointmap import MeanCanonicalMap, PointmapTask
from sapiens2.tasks.pose import PoseTask
from sapiens2.labels import IGNORE_INDEX
from sapiens2.tasks.seg import SegTask

Batch = dict[str, Any]


class TrivialBaseline(abc.ABC):
    """Accumulates train statistics batch by batch, then predicts without reading the pixels."""

    @abc.abstractmethod
    def update(self, batch: Batch) -> None:
        """Add one training batch to the statistics."""

    @abc.abstractmethod
    def predict(self, batch: Batch) -> Any:
        """The prediction for `batch` in the format of the task's `metric().update`."""

    def fit(self, batches: Iterable[Batch]) -> TrivialBaseline:
        for batch in batches:
            self.update(batch)
        return self

    def _check_fitted(self, fitted: bool) -> None:
        if not fitted:
            raise ValueError(f"{type(self).__name__}.predict called before fitting on labelled data")


class ClassPrior(TrivialBaseline):
    """Per-pixel majority class of the train labels (255 ignored), as log-frequency logits.

    Pixels never labelled fall back to the global class frequencies; they are added at half a
    count so they only break ties and can never overturn a strict per-pixel majority.
    """

    def __init__(self, task: SegTask) -> None:
        self.num_classes = task.num_classes
        self.counts: torch.Tensor | None = None

    def update(self, batch: Batch) -> None:
        labels = batch["seg"].long()
        c, (h, w) = self.num_classes, labels.shape[-2:]
        if self.counts is None:
            self.counts = torch.zeros(c * h * w, dtype=torch.int64)
        pixel = torch.arange(h * w).expand(labels.shape[0], h * w)
        flat = labels.reshape(labels.shape[0], -1)
        valid = (flat != IGNORE_INDEX) & (flat >= 0) & (flat < c)
        self.counts += torch.bincount(flat[valid] * h * w + pixel[valid], minlength=c * h * w)

    def logits(self, height: int, width: int) -> torch.Tensor:
        self._check_fitted(self.counts is not None and bool(self.counts.sum()))
        counts = self.counts.reshape(self.num_classes, -1).double()
        if counts.shape[1] != height * width:
            raise ValueError(f"class prior fitted on {counts.shape[1]} pixels, batch has {height}x{width}")
        global_freq = counts.sum(dim=1, keepdim=True) / counts.sum()
        return (counts + 0.5 * global_freq + 1e-6).log().reshape(self.num_classes, height, width).float()

    def predict(self, batch: Batch) -> torch.Tensor:
        b, (h, w) = batch["image"].shape[0], batch["image"].shape[-2:]
        return self.logits(h, w).expand(b, -1, -1, -1)


class ConstantMean(TrivialBaseline):
    """The train mean of a (B, 3, H, W) label over masked pixels, the same at every pixel;
    `unit=True` renormalises it (the mean direction of normals)."""

    def __init__(self, field: str, unit: bool = False) -> None:
        self.field, self.unit = field, unit
        self.total = torch.zeros(3, dtype=torch.float64)
        self.count = 0

    def update(self, batch: Batch) -> None:
        values = batch[self.field].double().permute(0, 2, 3, 1)[batch["mask"]]
        self.total += values.sum(dim=0)
        self.count += values.shape[0]

    def value(self) -> torch.Tensor:
        self._check_fitted(self.count > 0)
        mean = self.total / self.count
        return (F.normalize(mean, dim=0) if self.unit else mean).float()

    def predict(self, batch: Batch) -> torch.Tensor:
        b, (h, w) = batch["image"].shape[0], batch["image"].shape[-2:]
        return self.value()[None, :, None, None].expand(b, 3, h, w)


class InputImage(TrivialBaseline):
    """The input picture itself as albedo: what a model that learned nothing but copying gets."""

    def update(self, batch: Batch) -> None:
        pass

    def predict(self, batch: Batch) -> torch.Tensor:
        return batch["image_uint8"].permute(0, 3, 1, 2).float() / 255.0


class MeanCanonicalPointmap(TrivialBaseline):
    """Per-pixel mean of the train canonical pointmaps and the mean scale s (`MeanCanonicalMap`).

    Output is the `PointmapHead` dict, the metric pointmap being canonical / s.
    """

    def __init__(self, task: PointmapTask) -> None:
        self.mean = MeanCanonicalMap(task.canonical_focal_per_width)

    def update(self, batch: Batch) -> None:
        self.mean.update(batch)

    def canonical(self) -> torch.Tensor:
        self._check_fitted(self.mean.fitted)
        return self.mean.canonical()

    def predict(self, batch: Batch) -> dict[str, torch.Tensor]:
        canonical = self.canonical().expand(batch["image"].shape[0], -1, -1, -1)
        scale = torch.full((canonical.shape[0],), self.mean.mean_scale)
        return {"pointmap": canonical / scale[:, None, None, None], "canonical": canonical, "scale": scale}


class MeanSkeletonInBox(TrivialBaseline):
    """Mean train skeleton in box-normalised coordinates, placed in each person's box and
    rendered with the task's UDP codec, so `OKSMetric` decodes it back to the placed points.

    Only visible keypoints enter the mean; a keypoint never visible in training gets an empty
    heatmap (decoded with score 0).
    """

    def __init__(self, task: PoseTask) -> None:
        self.task = task
        self.sum = torch.zeros(task.num_keypoints, 2, dtype=torch.float64)
        self.count = torch.zeros(task.num_keypoints, dtype=torch.float64)

    def update(self, batch: Batch) -> None:
        keypoints, box = batch["keypoints"].double(), batch["bbox"].double()
        origin, size = box[:, None, :2], (box[:, None, 2:] - box[:, None, :2]).clamp(min=1e-6)
        visible = (keypoints[..., 2] > 0).double()
        self.sum += (((keypoints[..., :2] - origin) / size) * visible[..., None]).sum(dim=0)
        self.count += visible.sum(dim=0)

    def template(self) -> torch.Tensor:
        """(K, 3): mean box-normalised x, y and 1 where the keypoint was ever visible."""
        self._check_fitted(bool(self.count.sum()))
        mean = self.sum / self.count.clamp(min=1)[:, None]
        return torch.cat([mean, (self.count > 0).double()[:, None]], dim=1)

    def keypoints(self, batch: Batch) -> torch.Tensor:
        """(B, K, 3) template placed in each image's box (x, y in pixels, visibility)."""
        box, template = batch["bbox"].double(), self.template()
        xy = box[:, None, :2] + template[None, :, :2] * (box[:, None, 2:] - box[:, None, :2])
        return torch.cat([xy, template[None, :, 2:].expand(len(box), -1, -1)], dim=-1).float()

    def predict(self, batch: Batch) -> torch.Tensor:
        height, width = batch["image"].shape[-2:]
        stride = self.task.heatmap_stride
        codec = self.task.codec((height // stride, width // stride), (height, width))
        heatmaps, _ = codec.encode(self.keypoints(batch))
        return heatmaps


TRIVIAL_BASELINES: dict[str, dict[str, Callable[[Task], TrivialBaseline]]] = {
    "pose": {"mean_skeleton_in_box": MeanSkeletonInBox},
    "seg": {"class_prior": ClassPrior},
    "normal": {"constant_mean": lambda task: ConstantMean("normal", unit=True)},
    "pointmap": {"constant_mean": MeanCanonicalPointmap},
    "albedo": {"constant_mean": lambda task: ConstantMean("albedo"), "input_image": lambda task: InputImage()},
}


def fit_baselines(task_name: str, task: Task, batches: Iterable[Batch]) -> dict[str, TrivialBaseline]:
    """Every trivial baseline of `task_name`, fitted in one pass over the training `batches`."""
    if task_name not in TRIVIAL_BASELINES:
        raise ValueError(f"no trivial baselines for task {task_name!r}; tasks: {sorted(TRIVIAL_BASELINES)}")
    baselines = {name: make(task) for name, make in TRIVIAL_BASELINES[task_name].items()}
    for batch in batches:
        for baseline in baselines.values():
            baseline.update(batch)
    return baselines
