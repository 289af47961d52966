"""Task heads shared by the five tasks (facts section 3), one definition each plus width tables.

- `DeconvHead`: transposed-conv upsampling stages then 1x1 convs (pose: 4x, segmentation: 16x).
- `PixelShuffleDecoder`: conv stem, 2x pixel-shuffle up-blocks, 3x3 convs, 1x1 output
  (normal, albedo and the pointmap's canonical XYZ: 16x).
- `ScaleBranch`: the pointmap head's global regressor of s = f_canonical / f_x.
- `PointmapHead`: the canonical XYZ decoder and the scale branch (plus, at the small scales, the
  silhouette-read offset on a fitted prior of `silhouette_depth`).

"reference" widths follow the facts for the 0.4b/0.8b models, with the sizes whose heads the
facts give other widths (pose for 1b, the pixel-shuffle decoders for 5b) looked up by the
backbone's width; "tiny" widths are 1/8 to 1/16 of them so a 2-core CPU fine-tunes the demo
models (128x96 images) at well under a second a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from sapiens2.data.normalize import IMAGE_MEAN, IMAGE_STD
from sapiens2.tasks.base import check_scale
from sapiens2.tasks.detail import DetailPyramid, detail_channels_after, join_detail
from sapiens2.tasks.norms import make_norm
from sapiens2.tasks.silhouette_depth import PRIOR_GRID, RESIDUAL_SCALE, SilhouetteOffset, prior_at


@dataclass(frozen=True)
class DeconvWidths:
    deconv: tuple[int, ...]
    convs: tuple[int, ...]


@dataclass(frozen=True)
class PixelShuffleWidths:
    upsample: tuple[int, ...]
    convs: tuple[int, ...]


@dataclass(frozen=True)
class ScaleBranchWidths:
    convs: tuple[int, ...]
    stride: int  # of each 1x1 conv; 2 subsamples the grid as in the reference head
    pooled_grid: tuple[int, int]  # (h, w) after pooling; (8, 6) is the reference 64x48 grid / 8
    mlp: tuple[int, ...]


POSE_WIDTHS = {
    "reference": DeconvWidths(deconv=(1024, 768), convs=(512, 512, 256)),
    "tiny": DeconvWidths(deconv=(128, 96), convs=(64, 64, 32)),
}
# Reference widths that differ by model size, keyed by the backbone's embed_dim.
POSE_WIDTHS_BY_EMBED_DIM = {1536: DeconvWidths(deconv=(1536, 1024), convs=(768, 512, 256))}  # 1b
SEG_WIDTHS = {
    "reference": DeconvWidths(deconv=(512, 256, 128, 64), convs=(64, 64)),
    "tiny": DeconvWidths(deconv=(64, 32, 16, 16), convs=(16, 16)),
}
PIXEL_SHUFFLE_WIDTHS = {
    "reference": PixelShuffleWidths(upsample=(768, 512, 256, 128), convs=(64, 32, 16)),
    "tiny": PixelShuffleWidths(upsample=(64, 32, 16, 8), convs=(8, 8, 8)),
}
PIXEL_SHUFFLE_WIDTHS_BY_EMBED_DIM = {
    2432: PixelShuffleWidths(upsample=(1536, 768, 512, 256), convs=(128, 64, 32)),  # 5b
}
SCALE_BRANCH_WIDTHS = {
    "reference": ScaleBranchWidths(
        convs=(1536, 512, 128), stride=2, pooled_grid=(8, 6), mlp=(512, 128)
    ),
    # Three stride-2 1x1 convs would keep only the top-left token of the tiny 8x6 grid, so the
    # tiny branch keeps the grid and averages every token instead.
    "tiny": ScaleBranchWidths(convs=(64, 32, 16), stride=1, pooled_grid=(1, 1), mlp=(32, 16)),
}


def select_widths(table: dict, scale: str, embed_dim: int, by_embed_dim: dict | None = None):
    """The widths of `scale`; at "reference" scale a size-specific entry wins when there is one."""
    if check_scale(scale) == "reference" and by_embed_dim and embed_dim in by_embed_dim:
        return by_embed_dim[embed_dim]
    return table[scale]


class ImageGuidance(nn.Module):
    """Refines a head's full-resolution features with the input image before the output conv.

    At the small recipes' 128x96 input the token grid is 8x6, so a head upsampling tokens alone
    cannot place a part boundary or an albedo edge finer than a 16-px patch; one 3x3 conv over
    [features, image] lets the pixels it already sees decide the detail. Only the "tiny" heads
    use it (``GUIDED_SCALES``): the reference heads keep the published layout.
    """

    def __init__(self, channels: int, norm: str = "instance") -> None:
        super().__init__()
        self.refine = nn.Sequential(*_conv_norm_act(channels + 3, channels, norm))

    def forward(self, x: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        if image.shape[-2:] != x.shape[-2:]:
            image = F.interpolate(image, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return self.refine(torch.cat([x, image.to(x.dtype)], dim=1))


GUIDED_SCALES = ("tiny",)


# Pixels per token of the small recipes' backbones (patch 16): the stride the heads upsample from.
TOKEN_STRIDE = 16


class DeconvHead(nn.Module):
    """ConvTranspose(k4, s2, p1, no bias) + IN + SiLU stages, 1x1 conv + IN + SiLU, 1x1 out.

    A guided head also joins the `DetailPyramid` level of each stage's resolution to its output
    and refines the last features with the image (`ImageGuidance`).
    """

    def __init__(self, in_channels: int, widths: DeconvWidths, out_channels: int,
                 image_guidance: bool = False, image_detail: bool | None = None) -> None:
        super().__init__()
        image_detail = image_guidance if image_detail is None else image_detail
        self.detail = DetailPyramid() if image_detail else None
        extra = detail_channels_after([TOKEN_STRIDE >> (i + 1) for i in range(len(widths.deconv))],
                                      self.detail and self.detail.channels)
        stages, channels = [], in_channels
        for width, joined in zip(widths.deconv, extra):
            stages.append(nn.Sequential(
                nn.ConvTranspose2d(channels, width, kernel_size=4, stride=2, padding=1, bias=False),
                make_norm("instance", width),
                nn.SiLU(),
            ))
            channels = width + joined
        self.stages = nn.ModuleList(stages)
        convs: list[nn.Module] = []
        for width in widths.convs:
            convs += [nn.Conv2d(channels, width, 1), make_norm("instance", width), nn.SiLU()]
            channels = width
        self.convs = nn.Sequential(*convs)
        self.guidance = ImageGuidance(channels) if image_guidance else None
        self.out = nn.Conv2d(channels, out_channels, 1)

    @property
    def takes_image(self) -> bool:
        return self.guidance is not None or self.detail is not None

    def forward(self, features: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        detail = _detail(self.detail, image)
        x = features
        for stage in self.stages:
            x = join_detail(stage(x), detail)
        return self.out(_guided(self.convs(x), self.guidance, image))


def _detail(pyramid: DetailPyramid | None, image: torch.Tensor | None) -> dict | None:
    if pyramid is None:
        return None
    if image is None:
        raise ValueError("this head refines with the input image: call it as head(features, image)")
    return pyramid(image)


def _guided(x: torch.Tensor, guidance: ImageGuidance | None, image: torch.Tensor | None) -> torch.Tensor:
    if guidance is None:
        return x
    if image is None:
        raise ValueError("this head refines with the input image: call it as head(features, image)")
    return guidance(x, image)


def _conv_norm_act(c_in: int, c_out: int, norm: str) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1), make_norm(norm, c_out), nn.SiLU()]


class PixelShuffleDecoder(nn.Module):
    """3x3 conv stem, up-blocks (3x3 conv to 4c, PixelShuffle(2), norm, SiLU), 3x3 convs, 1x1.

    A guided decoder joins the `DetailPyramid` level of each up-block's resolution to its output
    and refines the last features with the image (`ImageGuidance`).
    """

    def __init__(
        self,
        in_channels: int,
        widths: PixelShuffleWidths,
        out_channels: int,
        norm: str = "instance",
        image_guidance: bool = False,
        image_residual: bool = False,
    ) -> None:
        super().__init__()
        self.detail = DetailPyramid(norm=norm) if image_guidance else None
        extra = detail_channels_after([TOKEN_STRIDE >> (i + 1) for i in range(len(widths.upsample))],
                                      self.detail and self.detail.channels)
        self.stem = nn.Sequential(*_conv_norm_act(in_channels, widths.upsample[0], norm))
        stages, channels = [], widths.upsample[0]
        for width, joined in zip(widths.upsample, extra):
            stages.append(nn.Sequential(
                nn.Conv2d(channels, 4 * width, 3, padding=1),
                nn.PixelShuffle(2),
                make_norm(norm, width),
                nn.SiLU(),
            ))
            channels = width + joined
        self.stages = nn.ModuleList(stages)
        convs: list[nn.Module] = []
        for width in widths.convs:
            convs += _conv_norm_act(channels, width, norm)
            channels = width
        self.convs = nn.Sequential(*convs)
        self.guidance = ImageGuidance(channels, norm) if image_guidance else None
        self.out = nn.Conv2d(channels, out_channels, 1)
        if image_residual and (not image_guidance or out_channels != 3):
            raise ValueError("image_residual predicts a correction of the RGB input: needs image_guidance and 3 outputs")
        self.image_residual = image_residual
        if image_residual:
            # The first prediction is the input image itself, the strongest trivial albedo.
            nn.init.zeros_(self.out.weight)
            nn.init.zeros_(self.out.bias)

    @property
    def takes_image(self) -> bool:
        return self.guidance is not None

    def forward(self, features: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        detail = _detail(self.detail, image)
        x = self.stem(features)
        for stage in self.stages:
            x = join_detail(stage(x), detail)
        out = self.out(_guided(self.convs(x), self.guidance, image))
        if self.image_residual:
            out = out + F.interpolate(denormalize(image), size=out.shape[-2:], mode="bilinear", align_corners=False)
        return out


def denormalize(image: torch.Tensor) -> torch.Tensor:
    """A normalised (B, 3, H, W) image back to RGB in [0, 1]."""
    mean = image.new_tensor(IMAGE_MEAN).view(1, 3, 1, 1)
    std = image.new_tensor(IMAGE_STD).view(1, 3, 1, 1)
    return (image * std + mean) / 255.0


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


def build_deconv_head(
    embed_dim: int, widths: dict[str, DeconvWidths], scale: str, out: int,
    by_embed_dim: dict[int, DeconvWidths] | None = None, full_resolution: bool = False,
) -> DeconvHead:
    """At the guided scales every deconv head joins the image pyramid (`DetailPyramid`), and
    `full_resolution` heads (segmentation) also refine their last features with the image."""
    guided = scale in GUIDED_SCALES
    return DeconvHead(embed_dim, select_widths(widths, scale, embed_dim, by_embed_dim), out,
                      image_guidance=full_resolution and guided, image_detail=guided)


def build_pixel_shuffle_head(
    embed_dim: int, scale: str, out: int, norm: str = "instance", image_residual: bool = False
) -> PixelShuffleDecoder:
    """`image_residual` (albedo) predicts a correction added to the RGB input at the guided scales."""
    widths = select_widths(PIXEL_SHUFFLE_WIDTHS, scale, embed_dim, PIXEL_SHUFFLE_WIDTHS_BY_EMBED_DIM)
    guided = scale in GUIDED_SCALES
    return PixelShuffleDecoder(embed_dim, widths, out, norm, image_guidance=guided, image_residual=image_residual and guided)
