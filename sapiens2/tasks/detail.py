"""Image detail for the small recipes' heads: a strided conv pyramid over the input image whose
levels join the head's upsampling path where the resolutions meet (a U-Net skip).

At 128x96 a person is 10-15 px wide, under one 16-px patch, so the 8x6 token grid cannot say
where a forearm or a limb's edge lies inside its patch. The one full-resolution 3x3 conv of
`ImageGuidance` sees the pixels but only a 3x3 neighbourhood of them; the pyramid gives each
upsampling stage the image at its own resolution (strides 4, 2 and 1), so limb-wide context
and pixel edges reach the head before its last layers. The reference heads keep the published
layout; only the guided ("tiny") scales build it.
"""

from __future__ import annotations

import torch
from torch import nn

from sapiens2.tasks.norms import make_norm

# Channels of the pyramid level at each stride (image pixels per feature cell).
DETAIL_CHANNELS = {1: 16, 2: 24, 4: 32}


class DetailPyramid(nn.Module):
    """conv3x3 + norm + SiLU at stride 1, then one stride-2 conv3x3 level per larger stride."""

    def __init__(self, channels: dict[int, int] = DETAIL_CHANNELS, norm: str = "instance") -> None:
        super().__init__()
        strides = sorted(channels)
        if strides[0] != 1 or any(b != 2 * a for a, b in zip(strides, strides[1:])):
            raise ValueError(f"detail strides must be 1, 2, 4, ... doubling; got {strides}")
        self.channels = dict(channels)
        levels, c_in = [], 3
        for stride in strides:
            c_out = channels[stride]
            levels.append(nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, stride=1 if stride == 1 else 2, padding=1),
                make_norm(norm, c_out), nn.SiLU(),
            ))
            c_in = c_out
        self.levels = nn.ModuleList(levels)

    def forward(self, image: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
        """Each level's features keyed by their (height, width)."""
        out, x = {}, image
        for level in self.levels:
            x = level(x)
            out[tuple(x.shape[-2:])] = x
        return out


def join_detail(x: torch.Tensor, detail: dict[tuple[int, int], torch.Tensor] | None) -> torch.Tensor:
    """`x` with the pyramid level of its resolution appended along channels (if there is one)."""
    if not detail:
        return x
    level = detail.get(tuple(x.shape[-2:]))
    return x if level is None else torch.cat([x, level.to(x.dtype)], dim=1)


def detail_channels_after(stage_strides: list[int], channels: dict[int, int] | None) -> list[int]:
    """Extra input channels of the layer after each upsampling stage, given its output stride."""
    if not channels:
        return [0] * len(stage_strides)
    return [channels.get(s, 0) for s in stage_strides]
