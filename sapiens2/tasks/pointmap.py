"""Pointmap: canonical XYZ decoder + scale branch, geometric losses, canonical and metric errors.

The head predicts the pointmap of a canonical camera with focal f_canonical (the metric
pointmap scaled isotropically by s = f_canonical / f_x, as in the reference data pipeline) and
s itself; the metric pointmap in metres is canonical / s. f_canonical is 768 at the reference
width of 768 pixels, so it is expressed per pixel of image width and scales with the input.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import cv2
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from sapiens2.data.dataset import collate
from sapiens2.tasks.angular import (
    accumulate_angular,
    angular_error_deg,
    empty_angular_state,
    summarize_angular,
)
from sapiens2.tasks.base import SummedStateMetric, Task, masked_label_maps, weighted_items
from sapiens2.tasks.channels import channel_cross, channel_norm
from sapiens2.tasks.pointmap_head import PointmapHead
from sapiens2.tasks.losses import cosine_distance, masked_l1, scale_invariant_log_loss
from sapiens2.tasks.silhouette_depth import prior_on_grid

WITHIN_M = (0.05, 0.10, 0.20)


def normals_from_pointmap(
    points: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised normals (B, 3, H-1, W-1) from forward differences, and where they are valid.

    dv x du points towards the camera for a surface facing it (x right, y down, z forward).
    A normal is valid when the pixel and its right and lower neighbours are all on the mask.
    """
    origin = points[:, :, :-1, :-1]
    du = points[:, :, :-1, 1:] - origin
    dv = points[:, :, 1:, :-1] - origin
    valid = mask[:, :-1, :-1] & mask[:, :-1, 1:] & mask[:, 1:, :-1]
    return channel_cross(dv, du), valid


def canonical_scale(
    batch: dict[str, Any], canonical_focal_per_width: float, like: torch.Tensor
) -> torch.Tensor:
    """Ground-truth s = f_canonical / f_x per image, f_canonical proportional to image width."""
    width = batch["image"].shape[-1]
    fx = batch["K"].to(like)[:, 0, 0]
    return canonical_focal_per_width * width / fx


class MeanCanonicalMap:
    """Per-pixel mean of canonical pointmaps (metric x s_gt) over the masked pixels of labelled
    batches, and the mean scale s: the mean-map baseline and the small head's prior. Pixels never
    on a mask take the mean over all masked pixels."""

    def __init__(self, canonical_focal_per_width: float) -> None:
        self.focal_per_width = canonical_focal_per_width
        self.sum: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.scale_sum, self.images = 0.0, 0

    def update(self, batch: dict[str, Any]) -> None:
        points = batch["pointmap"].double()
        s_gt = canonical_scale(batch, self.focal_per_width, points)
        mask = batch["mask"][:, None].to(points)
        if self.sum is None:
            self.sum, self.count = torch.zeros_like(points[0]), torch.zeros_like(mask[0, 0])
        self.sum += (points * s_gt[:, None, None, None] * mask).sum(dim=0)
        self.count += mask[:, 0].sum(dim=0)
        self.scale_sum += float(s_gt.sum())
        self.images += points.shape[0]

    @property
    def fitted(self) -> bool:
        return self.count is not None and bool(self.count.sum())

    @property
    def mean_scale(self) -> float:
        return self.scale_sum / self.images

    def canonical(self) -> torch.Tensor:
        if not self.fitted:
            raise ValueError("the mean canonical map needs labelled pixels; none were seen")
        overall = self.sum.sum(dim=(1, 2)) / self.count.sum()
        per_pixel = self.sum / self.count.clamp(min=1)
        return torch.where(self.count > 0, per_pixel, overall[:, None, None]).float()


@dataclass(frozen=True)
class PointmapTask(Task):
    """Camera-space pointmaps in metres with a per-image focal scale."""

    name: ClassVar[str] = "pointmap"
    # Scale-invariant: metric scale is not determinable from the image (PointmapMetric).
    primary_metric: ClassVar[str] = "canonical_l2_mean"
    higher_is_better: ClassVar[bool] = False

    canonical_focal_per_width: float = 1.0  # 768 px focal at the 768 px reference width
    canonical_l1_weight: float = 1.0
    depth_silog_weight: float = 1.0
    normal_cosine_weight: float = 1.0
    scale_l1_weight: float = 1.0
    silhouette_weight: float = 1.0  # BCE of the small head's silhouette (its offset reads it)
    silhouette_pos_weight: float = 1.0  # weight of the person pixels in that BCE (BCE's pos_weight)
    # The train mean canonical map (3, H, W), fitted by `with_label_statistics`; the small head
    # starts from it (`initialise_head`).
    canonical_prior: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def build_head(self, embed_dim: int, scale: str) -> nn.Module:
        return PointmapHead(embed_dim, scale)

    def with_label_statistics(self, samples: Any) -> PointmapTask:
        """The task holding the per-pixel mean canonical map of these samples (the mean-map
        baseline's definition, fitted to the images the run trains on)."""
        mean_map, chunk = MeanCanonicalMap(self.canonical_focal_per_width), []
        for sample in samples:
            chunk.append(sample)
            if len(chunk) == 64:
                mean_map.update(collate(chunk))
                chunk = []
        if chunk:
            mean_map.update(collate(chunk))
        return replace(self, canonical_prior=mean_map.canonical())

    def initialise_head(self, head: nn.Module) -> None:
        if self.canonical_prior is not None and getattr(head, "prior", None) is not None:
            with torch.no_grad():
                head.prior.copy_(prior_on_grid(self.canonical_prior))

    def loss(
        self, pred: dict[str, torch.Tensor], batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        canonical = pred["canonical"]
        mask = batch["mask"].to(canonical.device)
        s_gt = canonical_scale(batch, self.canonical_focal_per_width, canonical)
        target = batch["pointmap"].to(canonical) * s_gt[:, None, None, None]
        pred_normals, valid = normals_from_pointmap(canonical, mask)
        target_normals, _ = normals_from_pointmap(target, mask)
        terms = {}
        if "silhouette_logit" in pred:
            terms["silhouette_bce"] = (self.silhouette_weight, F.binary_cross_entropy_with_logits(
                pred["silhouette_logit"], mask.to(canonical.dtype),
                pos_weight=canonical.new_tensor(self.silhouette_pos_weight)))
        return weighted_items(
            terms | {
                "canonical_l1": (self.canonical_l1_weight, masked_l1(canonical, target, mask)),
                "depth_silog": (
                    self.depth_silog_weight,
                    scale_invariant_log_loss(canonical[:, 2], target[:, 2], mask),
                ),
                "normal_cosine_distance": (
                    self.normal_cosine_weight,
                    cosine_distance(pred_normals, target_normals, valid),
                ),
                "scale_l1": (self.scale_l1_weight, (pred["scale"] - s_gt).abs().mean()),
            }
        )

    def decode(self, pred: dict[str, torch.Tensor]) -> list[np.ndarray]:
        """(H, W, 3) float32 camera-space XYZ in metres; where the head predicts a silhouette, the
        points off it are zero, as off the person's mask in the labels."""
        points = pred["pointmap"].detach().float()
        if "silhouette_logit" in pred:
            points = points * (pred["silhouette_logit"].detach() > 0)[:, None]
        return list(points.permute(0, 2, 3, 1).cpu().numpy())

    def decode_labels(self, batch: dict[str, Any]) -> list[np.ndarray]:
        """(H, W, 3) float32 label XYZ in metres, zero off the person's mask."""
        return masked_label_maps(batch, "pointmap")

    def metric(self) -> PointmapMetric:
        return PointmapMetric(self.canonical_focal_per_width)

    def visualize(self, image_uint8: np.ndarray, output: np.ndarray) -> np.ndarray:
        """Depth (Z) colour map, near = warm, normalised to the 2-98th percentile of Z > 0."""
        depth = output[..., 2]
        positive = depth[depth > 0]
        if positive.size == 0:
            return np.zeros_like(image_uint8)
        lo, hi = np.percentile(positive, [2, 98])
        scaled = 1.0 - np.clip((depth - lo) / max(hi - lo, 1e-6), 0, 1)
        colored = cv2.applyColorMap((scaled * 255).astype(np.uint8), cv2.COLORMAP_TURBO)
        colored = cv2.cvtColor(colored, cv2.COLOR_BGR2RGB)
        return np.where((depth > 0)[..., None], colored, 0).astype(np.uint8)


class PointmapMetric(SummedStateMetric):
    """Pointmap errors over masked pixels, all from sums (metres, canonical units, fractions).

    canonical_l2_mean (the primary metric): mean Euclidean error between the predicted canonical
    map and the ground truth's (metric pointmap x s_gt); it is what the reference evaluator
    scores, since metric scale is not determinable from one image. Metric space: l2_mean: mean
    Euclidean error; rmse: sqrt of mean squared Euclidean error; mae_x/y/z: per-axis mean
    absolute error; within_<d>cm: fraction of pixels with Euclidean error below d;
    derived_normal_angular_error_*: angle between normals derived from the predicted and the
    ground-truth pointmaps. Scale, per image: scale_mae: mean |s - s_gt|; scale_rel_error: mean
    |s - s_gt| / s_gt.
    """

    def __init__(self, canonical_focal_per_width: float = 1.0) -> None:
        self.canonical_focal_per_width = canonical_focal_per_width
        super().__init__()

    def _empty_state(self) -> dict[str, np.ndarray]:
        state = {
            "sum_canonical_l2": np.zeros((), np.float64),
            "sum_l2": np.zeros((), np.float64),
            "sum_sq": np.zeros((), np.float64),
            "sum_abs": np.zeros(3, np.float64),
            "count": np.zeros((), np.int64),
            "within": np.zeros(len(WITHIN_M), np.int64),
            "sum_scale_abs": np.zeros((), np.float64),
            "sum_scale_rel": np.zeros((), np.float64),
            "images": np.zeros((), np.int64),
        }
        state.update({f"normal_{k}": v for k, v in empty_angular_state().items()})
        return state

    def update(self, pred: dict[str, torch.Tensor], batch: dict[str, Any]) -> None:
        points = pred["pointmap"].detach().double()
        target = batch["pointmap"].to(points)
        mask = batch["mask"].to(points.device)
        diff = (points - target).permute(0, 2, 3, 1)[mask]  # (N, 3)
        l2 = channel_norm(diff)
        self.state["sum_l2"] += l2.sum().item()
        self.state["sum_sq"] += l2.pow(2).sum().item()
        self.state["sum_abs"] += diff.abs().sum(dim=0).cpu().numpy()
        self.state["count"] += l2.numel()
        self.state["within"] += np.array([(l2 < d).sum().item() for d in WITHIN_M], np.int64)
        s_gt = canonical_scale(batch, self.canonical_focal_per_width, points)
        canonical_target = target * s_gt[:, None, None, None]
        canonical_diff = (pred["canonical"].detach().to(points) - canonical_target).permute(0, 2, 3, 1)[mask]
        self.state["sum_canonical_l2"] += channel_norm(canonical_diff).sum().item()
        scale_abs = (pred["scale"].detach().to(points) - s_gt).abs()
        self.state["sum_scale_abs"] += scale_abs.sum().item()
        self.state["sum_scale_rel"] += (scale_abs / s_gt).sum().item()
        self.state["images"] += points.shape[0]
        pred_normals, valid = normals_from_pointmap(points, mask)
        target_normals, _ = normals_from_pointmap(target, mask)
        accumulate_angular(
            self.state, angular_error_deg(pred_normals, target_normals)[valid], "normal_"
        )

    def compute(self) -> dict[str, float]:
        count = int(self.state["count"])
        if count == 0:
            raise ValueError("PointmapMetric.compute called with no masked pixels")
        mae = self.state["sum_abs"] / count
        images = int(self.state["images"])
        out = {
            "canonical_l2_mean": float(self.state["sum_canonical_l2"]) / count,
            "l2_mean": float(self.state["sum_l2"]) / count,
            "rmse": float(np.sqrt(self.state["sum_sq"] / count)),
            "mae_x": float(mae[0]),
            "mae_y": float(mae[1]),
            "mae_z": float(mae[2]),
            "scale_mae": float(self.state["sum_scale_abs"]) / images,
            "scale_rel_error": float(self.state["sum_scale_rel"]) / images,
        }
        for d, n in zip(WITHIN_M, self.state["within"], strict=True):
            out[f"within_{round(d * 100)}cm"] = int(n) / count
        if int(self.state["normal_count"]) > 0:
            out.update(summarize_angular(self.state, "derived_normal_angular_error", "normal_"))
        return out
