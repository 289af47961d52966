"""Task heads shared by the five tasks (facts section 3), one definition each plus width tables;
the pointmap head, built on `PixelShuffleDecoder`, is in `pointmap_head`.

- `DeconvHead`: transposed-conv upsampling stages then 1x1 convs (pose: 4x, segmentation: 16x).
- `PixelShuffleDecoder`: conv stem, 2x pixel-shuffle up-blocks, 3x3 convs, 1x1 output
  (normal, albedo and the pointmap's canonical XYZ: 16x).

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


@dataclass(frozen=True)
class DeconvWidths:
    deconv: tuple[int, ...]
    convs: tuple[int, ...]


@dataclass(frozen=True)
class PixelShuffleWidths:
    upsample: tuple[int, ...]
    convs: tuple[int, ...]


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
