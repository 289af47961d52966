"""Pose: heatmap head, visibility-weighted heatmap MSE, UDP codec, flip test, OKS AP, skeleton.

The spine uses the 17 COCO body keypoints; `keypoint_set="sapiens308"` switches to the
308-keypoint whole-body set of the reference models. Every setting that depends on the set
(count, flip pairs, OKS sigmas, skeleton) comes from it unless given explicitly, so the set is a
configuration, not a code change.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
import math
from typing import Any, ClassVar, Literal

import cv2
import numpy as np
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch import nn

from sapiens2.labels.keypoint_sets import get_keypoint_set
from sapiens2.tasks.base import Task
from sapiens2.tasks.heads import POSE_WIDTHS, POSE_WIDTHS_BY_EMBED_DIM, build_deconv_head
from sapiens2.tasks.keypoint_codec import UDPHeatmapCodec, flip_heatmaps, flip_index

COCO_STATS = ("AP", "AP50", "AP75", "APm", "APl", "AR", "AR50", "AR75", "ARm", "ARl")


@dataclass(frozen=True)
class PoseTask(Task):
    """Top-down keypoint heatmaps at 4x the token grid.

    sigma is in heatmap cells: 2 suits the 32x24 heatmaps of the 128x96 demo (and 64x48),
    6 the reference 256x192 heatmaps. num_keypoints, flip_pairs, oks_sigmas and skeleton left
    at None take the values of `keypoint_set` ("coco17" or "sapiens308").
    """

    name: ClassVar[str] = "pose"
    primary_metric: ClassVar[str] = "AP"
    higher_is_better: ClassVar[bool] = True

    keypoint_set: str = "coco17"
    num_keypoints: int | None = None
    sigma: float = 2.0
    flip_pairs: tuple[tuple[int, int], ...] | None = None
    oks_sigmas: tuple[float, ...] | None = None
    skeleton: tuple[tuple[int, int], ...] | None = None
    flip_test: bool = True
    heatmap_mse_weight: float = 10.0
    # "mse": the reference's heatmap regression. "spatial_ce": each keypoint's map is a softmax
    # over the cells, trained with cross-entropy against the normalised Gaussian target; every
    # cell gets gradient from the first step, so small models leave the all-zero plateau at once.
    heatmap_loss: Literal["mse", "spatial_ce"] = "mse"
    heatmap_stride: int = 4  # image pixels per heatmap cell: 16 per token / 4x upsampling
    # Top-down, as the reference evaluates: the (ground-truth or detected) person box, padded
    # by 1.25, fills the input, so the heatmaps spend their cells on the person.
    person_crop_padding: float | None = 1.25
    _flip_index: list[int] = field(init=False, repr=False, compare=False)
    # (name, keypoint indices) of the subsets OKS AP is also reported for.
    eval_groups: tuple[tuple[str, tuple[int, ...]], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        kset = get_keypoint_set(self.keypoint_set)
        for name in ("num_keypoints", "flip_pairs", "oks_sigmas", "skeleton"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(kset, name))
        same_set = self.num_keypoints == kset.num_keypoints
        object.__setattr__(self, "eval_groups", kset.eval_groups if same_set else ())
        if len(self.oks_sigmas) != self.num_keypoints:
            raise ValueError(
                f"oks_sigmas has {len(self.oks_sigmas)} values, need {self.num_keypoints}"
            )
        used = [i for pair in self.flip_pairs + self.skeleton for i in pair]
        if used and not 0 <= min(used) <= max(used) < self.num_keypoints:
            raise ValueError(f"flip_pairs/skeleton index outside 0..{self.num_keypoints - 1}")
        object.__setattr__(self, "_flip_index", flip_index(self.num_keypoints, self.flip_pairs))

    def build_head(self, embed_dim: int, scale: str) -> nn.Module:
        return build_deconv_head(embed_dim, POSE_WIDTHS, scale, self.num_keypoints, POSE_WIDTHS_BY_EMBED_DIM)

    def codec(
        self, heatmap_size: tuple[int, int], input_size: tuple[int, int] | None = None
    ) -> UDPHeatmapCodec:
        if input_size is None:
            input_size = (
                heatmap_size[0] * self.heatmap_stride,
                heatmap_size[1] * self.heatmap_stride,
            )
        return UDPHeatmapCodec(input_size=input_size, heatmap_size=heatmap_size, sigma=self.sigma)

    def loss(
        self, pred: torch.Tensor, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        codec = self.codec(tuple(pred.shape[-2:]), tuple(batch["image"].shape[-2:]))
        target, weight = codec.encode(batch["keypoints"].to(pred))
        if self.heatmap_loss == "spatial_ce":
            log_probs = torch.log_softmax(pred.flatten(-2).float(), dim=-1)
            dist = target.flatten(-2) / target.flatten(-2).sum(-1, keepdim=True).clamp_min(1e-12)
            ce = -(dist * log_probs).sum(-1)
            spatial_ce = (ce * weight).sum() / weight.sum().clamp_min(1.0)
            return spatial_ce, {"spatial_ce": float(spatial_ce.detach()), "loss": float(spatial_ce.detach())}
        # Mean over all B*K*h*w cells with unlabelled or off-map keypoints zeroed (MMPose's
        # KeypointMSELoss with target weights).
        heatmap_mse = ((pred - target).pow(2) * weight[..., None, None]).mean()
        total = self.heatmap_mse_weight * heatmap_mse
        return total, {"heatmap_mse": float(heatmap_mse.detach()), "loss": float(total.detach())}

    def heatmaps(self, output: torch.Tensor) -> torch.Tensor:
        """The model output as heatmaps the codec decodes: as is for "mse"; for "spatial_ce" the
        softmax over cells, scaled by 2 pi sigma^2 so a perfect Gaussian peaks at 1 like the
        regression targets (scores stay comparable and the overlay threshold keeps its meaning)."""
        if self.heatmap_loss == "mse":
            return output
        probs = torch.softmax(output.flatten(-2).float(), dim=-1).reshape(output.shape)
        return probs * (2 * math.pi * self.sigma**2)

    @torch.no_grad()
    def predict(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """Heatmaps, averaged with those of the mirrored image when flip_test is on."""
        heatmaps = self.heatmaps(model(images))
        if self.flip_test:
            flipped = self.heatmaps(model(images.flip(-1)))
            heatmaps = 0.5 * (heatmaps + flip_heatmaps(flipped, self._flip_index))
        return heatmaps

    def decode(self, pred: torch.Tensor) -> list[np.ndarray]:
        """(K, 3) arrays per image: x, y in image pixels and a peak-height score."""
        codec = self.codec(tuple(pred.shape[-2:]))
        return list(codec.decode(pred.detach().float().cpu().numpy()))

    def decode_labels(self, batch: dict[str, Any]) -> list[np.ndarray]:
        """(K, 3) arrays per image: x, y and the visibility flag in the score's place, so that
        `visualize` draws the labelled joints (1, 2) and skips the unlabelled ones (0)."""
        return list(batch["keypoints"].detach().float().cpu().numpy())

    def metric(self) -> OKSMetric:
        return OKSMetric(self)

    def visualize(
        self, image_uint8: np.ndarray, output: np.ndarray, min_score: float = 0.2
    ) -> np.ndarray:
        canvas = np.ascontiguousarray(image_uint8.copy())
        scale = max(1, round(min(canvas.shape[:2]) / 128))
        points = [(int(round(x - 0.5)), int(round(y - 0.5)), s >= min_score) for x, y, s in output]
        for i, (a, b) in enumerate(self.skeleton):
            if points[a][2] and points[b][2]:
                color = _limb_color(i, len(self.skeleton))
                cv2.line(canvas, points[a][:2], points[b][:2], color, scale, cv2.LINE_AA)
        for x, y, ok in points:
            if ok:
                cv2.circle(canvas, (x, y), scale + 1, (255, 255, 255), -1, cv2.LINE_AA)
        return canvas


def _limb_color(i: int, n: int) -> tuple[int, int, int]:
    hue = np.uint8([[[int(180 * i / max(n, 1)), 255, 255]]])
    return tuple(int(c) for c in cv2.cvtColor(hue, cv2.COLOR_HSV2RGB)[0, 0])


class OKSMetric:
    """COCO keypoint AP/AR (OKS) through pycocotools' COCOeval.

    State is one record per image (ground truth, bbox and the decoded prediction), so merging
    ranks concatenates lists. Images get COCO ids in the sorted order of their dataset ids, which
    makes the result independent of batch and merge order. Object area is the bbox area. COCO
    reports -1 for a statistic with no ground truth in its area range (e.g. APm on tiny images).
    """

    def __init__(self, task: PoseTask) -> None:
        self.task = task
        self.records: list[dict[str, Any]] = []

    def update(self, pred: torch.Tensor, batch: dict[str, Any]) -> None:
        codec = self.task.codec(tuple(pred.shape[-2:]), tuple(batch["image"].shape[-2:]))
        decoded = codec.decode(pred.detach().float().cpu().numpy())
        gts = batch["keypoints"].detach().cpu().numpy()
        boxes = batch["bbox"].detach().cpu().numpy()
        for image_id, gt, box, dt in zip(batch["id"], gts, boxes, decoded, strict=True):
            self.records.append(
                {
                    "id": str(image_id),
                    "gt": gt.astype(np.float32),
                    "bbox": box.astype(np.float32),
                    "dt": dt,
                }
            )

    def state_dict(self) -> dict[str, Any]:
        return {"records": [dict(r) for r in self.records]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = [dict(r) for r in state["records"]]

    def merge(self, other: OKSMetric) -> OKSMetric:
        self.records.extend(other.state_dict()["records"])
        return self

    def compute(self) -> dict[str, float]:
        """COCO stats over all keypoints, then `<group>_<stat>` for each of the task's
        eval_groups (e.g. body_AP, face_AP for the 308 set) with that subset's sigmas."""
        if not self.records:
            raise ValueError("OKSMetric.compute called before any update")
        records = sorted(self.records, key=lambda r: r["id"])
        sigmas = np.asarray(self.task.oks_sigmas, dtype=np.float64)
        out = _coco_keypoint_stats(records, np.arange(len(sigmas)), sigmas)
        for group, index in self.task.eval_groups:
            idx = np.asarray(index)
            stats = _coco_keypoint_stats(records, idx, sigmas[idx])
            out |= {f"{group}_{name}": value for name, value in stats.items()}
        return out


def _coco_keypoint_stats(
    records: list[dict[str, Any]], index: np.ndarray, sigmas: np.ndarray
) -> dict[str, float]:
    """COCOeval keypoint stats over the keypoints `index` of each record (ids 1.. in order).

    A person with none of these keypoints labelled is ignored by COCOeval (num_keypoints 0).
    """
    images, gts, dts = [], [], []
    for image_id, rec in enumerate(records, start=1):
        x0, y0, x1, y1 = (float(v) for v in rec["bbox"])
        gt = rec["gt"][index]
        gt_kpts = gt.copy()
        gt_kpts[gt_kpts[:, 2] <= 0] = 0.0  # COCO convention: unlabelled keypoints are 0,0,0
        images.append({"id": image_id})
        gts.append(
            {
                "id": image_id,
                "image_id": image_id,
                "category_id": 1,
                "iscrowd": 0,
                "bbox": [x0, y0, x1 - x0, y1 - y0],
                "area": max(x1 - x0, 0.0) * max(y1 - y0, 0.0),
                "keypoints": gt_kpts.reshape(-1).tolist(),
                "num_keypoints": int((gt[:, 2] > 0).sum()),
            }
        )
        dt = rec["dt"]
        dt_kpts = np.concatenate([dt[:, :2], np.ones((len(dt), 1), np.float32)], axis=1)[index]
        dts.append(
            {
                "image_id": image_id,
                "category_id": 1,
                "keypoints": dt_kpts.reshape(-1).tolist(),
                # The person's score comes from all its keypoints, so every subset ranks
                # detections the same way.
                "score": float(np.clip(dt[:, 2], 0.0, None).mean()),
            }
        )
    with contextlib.redirect_stdout(io.StringIO()):  # COCOeval prints its progress tables
        coco_gt = COCO()
        coco_gt.dataset = {
            "images": images,
            "annotations": gts,
            "categories": [{"id": 1, "name": "person"}],
        }
        coco_gt.createIndex()
        evaluator = COCOeval(coco_gt, coco_gt.loadRes(dts), "keypoints")
        evaluator.params.kpt_oks_sigmas = sigmas
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return {name: float(v) for name, v in zip(COCO_STATS, evaluator.stats, strict=True)}
