"""Surface normals: pixel-shuffle decoder, cosine + L1 + gradient L1 loss, angular-error metric."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from sapiens2.tasks.angular import (
    accumulate_angular,
    angular_error_deg,
    empty_angular_state,
    summarize_angular,
)
from sapiens2.tasks.base import SummedStateMetric, Task, masked_label_maps, weighted_items
from sapiens2.tasks.channels import unit_channels
from sapiens2.tasks.heads import build_pixel_shuffle_head
from sapiens2.tasks.losses import cosine_distance, gradient_l1, masked_l1


@dataclass(frozen=True)
class NormalTask(Task):
    """Camera-space unit normals (B, 3, H, W); losses and metrics on the person mask only."""

    name: ClassVar[str] = "normal"
    primary_metric: ClassVar[str] = "angular_error_mean"
    higher_is_better: ClassVar[bool] = False

    cosine_weight: float = 10.0
    l1_weight: float = 1.0
    gradient_l1_weight: float = 10.0

    def build_head(self, embed_dim: int, scale: str) -> nn.Module:
        return build_pixel_shuffle_head(embed_dim, scale, 3)

    def loss(
        self, pred: torch.Tensor, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        target = batch["normal"].to(pred)
        mask = batch["mask"].to(pred.device)
        unit = unit_channels(pred, eps=1e-6)
        return weighted_items(
            {
                "cosine_distance": (self.cosine_weight, cosine_distance(pred, target, mask)),
                "normal_l1": (self.l1_weight, masked_l1(unit, target, mask)),
                "normal_gradient_l1": (self.gradient_l1_weight, gradient_l1(unit, target, mask)),
            }
        )

    def decode(self, pred: torch.Tensor) -> list[np.ndarray]:
        """(H, W, 3) float32 unit normals."""
        unit = unit_channels(pred.detach().float(), eps=1e-6)
        return list(unit.permute(0, 2, 3, 1).cpu().numpy())

    def decode_labels(self, batch: dict[str, Any]) -> list[np.ndarray]:
        """(H, W, 3) float32 label normals, 0 (drawn grey) off the mask."""
        return masked_label_maps(batch, "normal")

    def metric(self) -> NormalMetric:
        return NormalMetric()

    def visualize(self, image_uint8: np.ndarray, output: np.ndarray) -> np.ndarray:
        """The usual normal-map colouring: (n + 1) / 2 as RGB."""
        return ((output + 1.0) * 127.5).clip(0, 255).round().astype(np.uint8)


class NormalMetric(SummedStateMetric):
    """Angular error (degrees) of predicted vs ground-truth normals over masked pixels."""

    def _empty_state(self) -> dict[str, np.ndarray]:
        return empty_angular_state()

    def update(self, pred: torch.Tensor, batch: dict[str, Any]) -> None:
        errors = angular_error_deg(pred.detach().float(), batch["normal"].to(pred.device).float())
        accumulate_angular(self.state, errors[batch["mask"].to(pred.device)])

    def compute(self) -> dict[str, float]:
        return summarize_angular(self.state, "angular_error")
