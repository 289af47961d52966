"""Albedo: RMSNorm pixel-shuffle decoder, L1 + gradient L1 + chromaticity L1, MAE/RMSE/PSNR/SSIM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from sapiens2.tasks.base import SummedStateMetric, Task, masked_label_maps, weighted_items
from sapiens2.tasks.heads import build_pixel_shuffle_head
from sapiens2.tasks.losses import chromaticity, gradient_l1, masked_l1, masked_mean


def gaussian_kernel_1d(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """The normalised 1-D Gaussian whose outer product is SSIM's 2-D window."""
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def ssim_map(pred: torch.Tensor, target: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Per-pixel SSIM (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5), channel mean (B, H, W).

    Reflect padding keeps the map the image size so it can be averaged under the person mask.
    The window is separable, so the five local moments are blurred together as one row pass and
    one column pass: 22 taps a pixel instead of 121, the same map to float64 rounding (the 2-D
    float64 convolution took 50 of the demo evaluation's 91 s).
    """
    c = pred.shape[1]
    g = gaussian_kernel_1d().to(pred)
    pad = g.numel() // 2
    moments = torch.cat([pred, target, pred * pred, target * target, pred * target], dim=1)
    n = moments.shape[1]
    blurred = F.pad(moments, (pad,) * 4, mode="reflect")
    blurred = F.conv2d(blurred, g.view(1, 1, 1, -1).expand(n, 1, 1, -1), groups=n)
    blurred = F.conv2d(blurred, g.view(1, 1, -1, 1).expand(n, 1, -1, 1), groups=n)
    mu_p, mu_t, mean_pp, mean_tt, mean_pt = blurred.split(c, dim=1)
    var_p = mean_pp - mu_p**2
    var_t = mean_tt - mu_t**2
    cov = mean_pt - mu_p * mu_t
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    ssim = ((2 * mu_p * mu_t + c1) * (2 * cov + c2)) / (
        (mu_p**2 + mu_t**2 + c1) * (var_p + var_t + c2)
    )
    return ssim.mean(dim=1)


@dataclass(frozen=True)
class AlbedoTask(Task):
    """Diffuse albedo as RGB in [0, 1]; losses and metrics on the person mask only."""

    name: ClassVar[str] = "albedo"
    primary_metric: ClassVar[str] = "psnr"
    higher_is_better: ClassVar[bool] = True

    l1_weight: float = 2.0
    gradient_l1_weight: float = 2.0
    chromaticity_l1_weight: float = 1.0
    # At the small recipes' guided heads: predict a correction of the input image (the image is
    # shading times albedo), starting from the identity instead of a constant.
    image_residual: bool = True

    def build_head(self, embed_dim: int, scale: str) -> nn.Module:
        return build_pixel_shuffle_head(embed_dim, scale, 3, norm="rms", image_residual=self.image_residual)

    def loss(
        self, pred: torch.Tensor, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        target = batch["albedo"].to(pred)
        mask = batch["mask"].to(pred.device)
        return weighted_items(
            {
                "albedo_l1": (self.l1_weight, masked_l1(pred, target, mask)),
                "albedo_gradient_l1": (self.gradient_l1_weight, gradient_l1(pred, target, mask)),
                "chromaticity_l1": (
                    self.chromaticity_l1_weight,
                    masked_l1(chromaticity(pred), chromaticity(target), mask),
                ),
            }
        )

    def decode(self, pred: torch.Tensor) -> list[np.ndarray]:
        """(H, W, 3) float32 albedo clipped to [0, 1]."""
        return list(pred.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy())

    def decode_labels(self, batch: dict[str, Any]) -> list[np.ndarray]:
        """(H, W, 3) float32 label albedo in [0, 1], 0 (drawn black) off the mask."""
        return masked_label_maps(batch, "albedo")

    def metric(self) -> AlbedoMetric:
        return AlbedoMetric()

    def visualize(self, image_uint8: np.ndarray, output: np.ndarray) -> np.ndarray:
        return (np.clip(output, 0, 1) * 255).round().astype(np.uint8)


class AlbedoMetric(SummedStateMetric):
    """MAE, RMSE and PSNR over all masked pixel-channels of the data set (values in [0, 1],
    PSNR = 10 log10(1 / MSE)), and SSIM averaged under each image's mask then over images."""

    def _empty_state(self) -> dict[str, np.ndarray]:
        return {
            "sum_abs": np.zeros((), np.float64),
            "sum_sq": np.zeros((), np.float64),
            "count": np.zeros((), np.int64),
            "sum_ssim": np.zeros((), np.float64),
            "images": np.zeros((), np.int64),
        }

    def update(self, pred: torch.Tensor, batch: dict[str, Any]) -> None:
        pred = pred.detach().double().clamp(0, 1)
        target = batch["albedo"].to(pred)
        mask = batch["mask"].to(pred.device)
        channels = pred.shape[1]
        diff = (pred - target) * mask[:, None]
        self.state["sum_abs"] += diff.abs().sum().item()
        self.state["sum_sq"] += diff.pow(2).sum().item()
        self.state["count"] += int(mask.sum().item()) * channels
        ssim = ssim_map(pred, target)
        for image_ssim, image_mask in zip(ssim, mask, strict=True):
            if image_mask.any():
                self.state["sum_ssim"] += masked_mean(image_ssim[None], image_mask[None]).item()
                self.state["images"] += 1

    def compute(self) -> dict[str, float]:
        count = int(self.state["count"])
        if count == 0:
            raise ValueError("AlbedoMetric.compute called with no masked pixels")
        mse = float(self.state["sum_sq"]) / count
        return {
            "mae": float(self.state["sum_abs"]) / count,
            "rmse": float(np.sqrt(mse)),
            "psnr": float(10 * np.log10(1.0 / max(mse, 1e-12))),
            "ssim": float(self.state["sum_ssim"]) / int(self.state["images"]),
        }
