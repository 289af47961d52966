"""The pointmap head (facts section 3): a canonical-camera XYZ decoder (`PixelShuffleDecoder`) and
`ScaleBranch`, the global regressor of s = f_canonical / f_x; at the small scales also the
silhouette-read offset on a fitted prior of `silhouette_depth`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from sapiens2.tasks.heads import (
    GUIDED_SCALES, PIXEL_SHUFFLE_WIDTHS, PIXEL_SHUFFLE_WIDTHS_BY_EMBED_DIM, PixelShuffleDecoder, select_widths,
)
from sapiens2.tasks.silhouette_depth import PRIOR_GRID, RESIDUAL_SCALE, SilhouetteOffset, prior_at


@dataclass(frozen=True)
class ScaleBranchWidths:
    convs: tuple[int, ...]
    stride: int  # of each 1x1 conv; 2 subsamples the grid as in the reference head
    pooled_grid: tuple[int, int]  # (h, w) after pooling; (8, 6) is the reference 64x48 grid / 8
    mlp: tuple[int, ...]


SCALE_BRANCH_WIDTHS = {
    "reference": ScaleBranchWidths(
        convs=(1536, 512, 128), stride=2, pooled_grid=(8, 6), mlp=(512, 128)
    ),
    # Three stride-2 1x1 convs would keep only the top-left token of the tiny 8x6 grid, so the
    # tiny branch keeps the grid and averages every token instead.
    "tiny": ScaleBranchWidths(convs=(64, 32, 16), stride=1, pooled_grid=(1, 1), mlp=(32, 16)),
}


class ScaleBranch(nn.Module):
    """1x1 convs (stride 2 at reference widths), pooled to a fixed grid, MLP to one scalar > 0.

    At the reference 64x48 token grid three stride-2 convs give exactly the 8x6 grid of the
    facts, so the adaptive pool is the identity there; it only matters for other input sizes.
    """

    def __init__(self, in_channels: int, widths: ScaleBranchWidths) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for width in widths.convs:
            layers += [nn.Conv2d(channels, width, 1, stride=widths.stride), nn.SiLU()]
            channels = width
        layers.append(nn.AdaptiveAvgPool2d(widths.pooled_grid))
        self.convs = nn.Sequential(*layers)
        mlp: list[nn.Module] = [nn.Flatten()]
        features = channels * widths.pooled_grid[0] * widths.pooled_grid[1]
        for width in widths.mlp:
            mlp += [nn.Linear(features, width), nn.SiLU()]
            features = width
        mlp.append(nn.Linear(features, 1))
        self.mlp = nn.Sequential(*mlp)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # softplus keeps s > 0 (it divides the canonical pointmap) without exp's blow-ups.
        return F.softplus(self.mlp(self.convs(features))).squeeze(1) + 1e-4


class PointmapHead(nn.Module):
    """Canonical-camera XYZ decoder plus the scale branch.

    The canonical pointmap is the metric one scaled by s = f_canonical / f_x (isotropic, as in
    the reference data pipeline), so the metric pointmap in metres is canonical / s. At the
    guided scales the decoder also predicts a silhouette and adds a residual to a prior canonical
    map (the train mean map, `PointmapTask.initialise_head`) shifted per image by an offset read
    off the silhouette (`sapiens2.tasks.silhouette_depth`, with the measurements behind it).
    """

    def __init__(self, in_channels: int, scale: str) -> None:
        super().__init__()
        widths = select_widths(PIXEL_SHUFFLE_WIDTHS, scale, in_channels, PIXEL_SHUFFLE_WIDTHS_BY_EMBED_DIM)
        guided = scale in GUIDED_SCALES
        # InstanceNorm removes each image's per-channel mean, and with it the per-image depth
        # offset the canonical map needs; the narrow guided decoder normalises over channels per
        # pixel (the albedo head's RMSNorm) instead.
        self.decoder = PixelShuffleDecoder(in_channels, widths, 4 if guided else 3, norm="rms" if guided else "instance",
                                           image_guidance=guided)
        self.scale_branch = ScaleBranch(in_channels, SCALE_BRANCH_WIDTHS[scale])
        self.silhouette_offset = SilhouetteOffset() if guided else None
        if guided:
            self.register_buffer("prior", torch.zeros(3, *PRIOR_GRID))
            with torch.no_grad():  # the first prediction is the prior; the silhouette starts as background
                self.decoder.out.weight[:3].zero_()
                self.decoder.out.bias[:3].zero_()
                self.decoder.out.bias[3].fill_(-1.0)

    @property
    def takes_image(self) -> bool:
        return self.decoder.takes_image

    def forward(self, features: torch.Tensor, image: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        decoded = self.decoder(features, image)
        s = self.scale_branch(features)
        if self.silhouette_offset is None:
            return {"pointmap": decoded / s[:, None, None, None], "canonical": decoded, "scale": s}
        silhouette_logit = decoded[:, 3]
        offset = self.silhouette_offset(torch.sigmoid(silhouette_logit))
        canonical = (prior_at(self.prior, decoded.shape[-2:]) + RESIDUAL_SCALE * decoded[:, :3]
                     + offset[:, :, None, None])
        return {"pointmap": canonical / s[:, None, None, None], "canonical": canonical, "scale": s,
                "silhouette_logit": silhouette_logit}
