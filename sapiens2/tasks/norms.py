"""Normalisations of (B, C, H, W) head feature maps, chosen by name."""

from __future__ import annotations

import torch
from torch import nn


class ChannelRMSNorm(nn.Module):
    """RMS normalisation over the channel axis of a (B, C, H, W) map, with a per-channel gain."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + self.eps)
        return x * rms * self.weight[None, :, None, None]


def make_norm(kind: str, channels: int) -> nn.Module:
    """"instance" (per image and channel) or "rms" (per pixel, over channels: keeps each image's
    offsets, which the pointmap and albedo heads need)."""
    if kind == "instance":
        return nn.InstanceNorm2d(channels, affine=True)
    if kind == "rms":
        return ChannelRMSNorm(channels)
    raise ValueError(f"unknown norm {kind!r}; expected 'instance' or 'rms'")
