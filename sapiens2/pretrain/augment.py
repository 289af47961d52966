"""Multi-crop augmentation for self-distillation: 2 global crops plus n local crops per image.

Global crops feed both the MAE and the distillation objectives, so they get geometric changes only
(random resized crop + horizontal flip): the paper keeps skin tone and lighting intact for albedo.
Local crops are smaller and also get colour jitter and random grayscale. All crops of a batch are
cut in one ``grid_sample`` call per view, with every random number drawn from the generator passed
in, so a batch is reproducible from a seed.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from sapiens2.data.normalize import IMAGE_MEAN, IMAGE_STD, normalize  # noqa: F401 (re-exported)

# RGB -> YIQ; a hue shift is a rotation of the (I, Q) chroma plane.
_RGB_TO_YIQ = torch.tensor(
    [[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]]
)
_YIQ_TO_RGB = torch.linalg.inv(_RGB_TO_YIQ)
_LUMA = _RGB_TO_YIQ[0]


def _uniform(shape: tuple[int, ...], low: float, high: float, g: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=g)


class MultiCropAugment:
    """Cuts ``2`` global and ``n_local`` local crops from a uint8 batch.

    ``__call__(images, generator)`` takes (B, H, W, 3) uint8 (numpy or torch) and returns
    ``dict(global_crops=[2 x (B, 3, *global_size)], local_crops=[n_local x (B, 3, *local_size)])``,
    float32 normalised. Sizes are (height, width).
    """

    def __init__(
        self,
        global_size: tuple[int, int] = (128, 96),
        local_size: tuple[int, int] = (64, 48),
        n_local: int = 2,
        global_scale: tuple[float, float] = (0.5, 1.0),
        local_scale: tuple[float, float] = (0.1, 0.4),
        brightness: float = 0.4,
        contrast: float = 0.4,
        saturation: float = 0.2,
        hue: float = 0.1,
        jitter_prob: float = 0.8,
        grayscale_prob: float = 0.2,
        flip_prob: float = 0.5,
    ) -> None:
        self.global_size = tuple(global_size)
        self.local_size = tuple(local_size)
        self.n_local = n_local
        self.global_scale = global_scale
        self.local_scale = local_scale
        self.brightness, self.contrast, self.saturation, self.hue = (
            brightness, contrast, saturation, hue
        )
        self.jitter_prob = jitter_prob
        self.grayscale_prob = grayscale_prob
        self.flip_prob = flip_prob

    def __call__(
        self, images: np.ndarray | torch.Tensor, generator: torch.Generator
    ) -> dict[str, list[torch.Tensor]]:
        batch = torch.as_tensor(images)
        if batch.dtype != torch.uint8 or batch.ndim != 4 or batch.shape[-1] != 3:
            raise ValueError(
                f"expected uint8 images (B, H, W, 3), got {tuple(batch.shape)} {batch.dtype}"
            )
        pixels = batch.permute(0, 3, 1, 2).float()
        global_crops = [
            normalize(self._crop(pixels, self.global_size, self.global_scale, generator))
            for _ in range(2)
        ]
        local_crops = []
        for _ in range(self.n_local):
            crop = self._crop(pixels, self.local_size, self.local_scale, generator)
            local_crops.append(normalize(self._color(crop, generator)))
        return {"global_crops": global_crops, "local_crops": local_crops}

    def _crop(
        self,
        pixels: torch.Tensor,
        out_size: tuple[int, int],
        scale: tuple[float, float],
        g: torch.Generator,
    ) -> torch.Tensor:
        """Random resized crop + horizontal flip, one box per image, resampled bilinearly."""
        b, _, height, width = pixels.shape
        out_h, out_w = out_size
        # Aspect jitter is relative to the output aspect, so an undistorted crop is the centre.
        tries = 10
        area = height * width * _uniform((b, tries), *scale, g)
        log_ratio = _uniform((b, tries), math.log(3 / 4), math.log(4 / 3), g)
        ratio = (out_w / out_h) * torch.exp(log_ratio)
        crop_w, crop_h = torch.sqrt(area * ratio), torch.sqrt(area / ratio)
        valid = (crop_w <= width) & (crop_h <= height)
        first = valid.float().argmax(dim=1, keepdim=True)
        crop_w = crop_w.gather(1, first).squeeze(1)
        crop_h = crop_h.gather(1, first).squeeze(1)
        # Fallback when no try fits: the largest box of the output aspect.
        none_fit = ~valid.any(dim=1)
        fit = min(width / out_w, height / out_h)
        crop_w = torch.where(none_fit, torch.full_like(crop_w, out_w * fit), crop_w)
        crop_h = torch.where(none_fit, torch.full_like(crop_h, out_h * fit), crop_h)
        left = torch.rand(b, generator=g) * (width - crop_w)
        top = torch.rand(b, generator=g) * (height - crop_h)
        flip = torch.rand(b, generator=g) < self.flip_prob

        # Affine map from output to input coordinates in grid_sample's [-1, 1] convention.
        theta = torch.zeros(b, 2, 3)
        theta[:, 0, 0] = torch.where(flip, -1.0, 1.0) * crop_w / width
        theta[:, 0, 2] = (2 * left + crop_w) / width - 1
        theta[:, 1, 1] = crop_h / height
        theta[:, 1, 2] = (2 * top + crop_h) / height - 1
        grid = F.affine_grid(theta, [b, 3, out_h, out_w], align_corners=False)
        return F.grid_sample(
            pixels, grid, mode="bilinear", padding_mode="border", align_corners=False
        )

    def _color(self, pixels: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """Colour jitter (brightness, contrast, saturation, hue) and random grayscale."""
        b = pixels.shape[0]
        jitter = (torch.rand(b, generator=g) < self.jitter_prob).view(b, 1, 1, 1)

        def factor(strength: float) -> torch.Tensor:
            drawn = _uniform((b, 1, 1, 1), 1 - strength, 1 + strength, g)
            return torch.where(jitter, drawn, 1.0)

        bright, contr = factor(self.brightness), factor(self.contrast)
        satur = factor(self.saturation)
        angle = torch.where(jitter.view(b), _uniform((b,), -self.hue, self.hue, g), 0.0)
        angle = angle * 2 * math.pi
        gray_out = (torch.rand(b, generator=g) < self.grayscale_prob).view(b, 1, 1, 1)

        x = (pixels * bright).clamp(0, 255)
        mean_luma = _luma(x).mean(dim=(2, 3), keepdim=True)
        x = ((x - mean_luma) * contr + mean_luma).clamp(0, 255)
        luma = _luma(x)
        x = ((x - luma) * satur + luma).clamp(0, 255)
        cos, sin = torch.cos(angle), torch.sin(angle)
        rotation = torch.zeros(b, 3, 3)
        rotation[:, 0, 0] = 1
        rotation[:, 1, 1], rotation[:, 1, 2] = cos, -sin
        rotation[:, 2, 1], rotation[:, 2, 2] = sin, cos
        hue_matrix = _YIQ_TO_RGB @ rotation @ _RGB_TO_YIQ
        x = torch.einsum("bij,bjhw->bihw", hue_matrix, x).clamp(0, 255)
        return torch.where(gray_out, _luma(x).expand_as(x), x)


def _luma(pixels: torch.Tensor) -> torch.Tensor:
    return torch.einsum("c,bchw->bhw", _LUMA, pixels).unsqueeze(1)
