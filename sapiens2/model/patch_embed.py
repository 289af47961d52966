"""Non-overlapping patch embedding."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class PatchEmbed(nn.Module):
    """Conv2d(in_channels -> dim, kernel = stride = patch_size, bias) then flatten.

    Returns the tokens (B, h * w, dim) in row-major patch order and the grid (h, w). Any input
    whose sides are multiples of the patch size is accepted: RoPE positions are normalised
    per axis, so no table is tied to one resolution.
    """

    def __init__(self, in_channels: int, dim: int, patch_size: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.projection = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

    def forward(
        self, images: Tensor, keep_idx: Tensor | None = None
    ) -> tuple[Tensor, tuple[int, int]]:
        """With ``keep_idx`` (B, N_keep) only those patches are embedded (B, N_keep, dim)."""
        channels = self.projection.in_channels
        if images.ndim != 4 or images.shape[1] != channels:
            raise ValueError(f"expected images (B, {channels}, H, W), got {tuple(images.shape)}")
        height, width = images.shape[-2:]
        size = self.patch_size
        if height % size or width % size:
            raise ValueError(
                f"image size {height}x{width} is not a multiple of the patch size {size}"
            )
        grid = (height // size, width // size)
        if keep_idx is None:
            return self.projection(images).flatten(2).transpose(1, 2), grid
        # Masked pretraining: gather the visible patches first, so the projection and its
        # weight gradient cost scales with the visible tokens only. unfold's (C, kh, kw)
        # feature order matches the conv weight layout.
        patches = F.unfold(images, kernel_size=size, stride=size).transpose(1, 2)
        patches = patches.gather(1, keep_idx.unsqueeze(-1).expand(-1, -1, patches.shape[-1]))
        return F.linear(patches, self.projection.weight.flatten(1), self.projection.bias), grid
