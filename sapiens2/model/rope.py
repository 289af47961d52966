"""2D rotary position embedding on the patch grid (per-axis normalised coordinates)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

ROPE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class RopePositionEmbedding(nn.Module):
    """Builds the sin/cos tables of a 2D RoPE for one head dimension.

    Patch (i, j) of an h x w grid sits at c_h = 2(i + 0.5)/h - 1, c_w = 2(j + 0.5)/w - 1.
    With head dim d there are d/4 periods ``base ** (2k / (d/2))``; the angle vector
    ``[2 pi c_h / periods, 2 pi c_w / periods]`` is tiled twice to length d, matching
    :func:`rotate_half`, which pairs channel m with channel m + d/2.

    The tables are computed in ``dtype`` (bf16 by default, like the reference, whose weights
    were trained with bf16 angles). ``periods`` is a persistent buffer so that the reference
    checkpoints, which contain it, load strictly.
    """

    def __init__(self, head_dim: int, base: float = 100.0, dtype: str = "bf16") -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"head_dim must be divisible by 4 for 2D RoPE, got {head_dim}")
        if dtype not in ROPE_DTYPES:
            raise ValueError(f"rope dtype must be one of {sorted(ROPE_DTYPES)}, got {dtype!r}")
        self.head_dim = head_dim
        self.base = base
        # Kept apart from periods.dtype: casting the whole model (e.g. .float()) must not
        # silently change the precision the tables are computed in.
        self.table_dtype = ROPE_DTYPES[dtype]
        self.register_buffer("periods", torch.empty(head_dim // 4, dtype=self.table_dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        exponents = 2 * torch.arange(self.head_dim // 4, dtype=torch.float64) / (self.head_dim // 2)
        self.periods.copy_(self.base**exponents)

    def forward(self, grid: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """Returns ``(sin, cos)``, each (h * w, head_dim), rows in row-major patch order."""
        height, width = grid
        factory = {"device": self.periods.device, "dtype": self.table_dtype}
        coords_h = torch.arange(0.5, height, **factory) / height
        coords_w = torch.arange(0.5, width, **factory) / width
        coords = torch.stack(torch.meshgrid(coords_h, coords_w, indexing="ij"), dim=-1)
        coords = 2.0 * coords.flatten(0, 1) - 1.0  # (hw, 2) in [-1, 1]
        periods = self.periods.to(self.table_dtype)
        angles = 2 * math.pi * coords[:, :, None] / periods[None, None, :]  # (hw, 2, d/4)
        angles = angles.flatten(1, 2).tile(2)  # (hw, d): [h-angles, w-angles] twice
        return torch.sin(angles), torch.cos(angles)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}, dtype={self.table_dtype}"


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] on the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
    """Rotates the last ``sin.shape[-2]`` tokens of ``x`` (B, heads, N, d); earlier (prefix)
    tokens pass through unrotated.

    ``sin``/``cos`` broadcast against (B, heads, N_patch, d): (N_patch, d) for the full grid,
    (B, 1, N_keep, d) for gathered visible tokens. The rotation runs in the table dtype and
    the result is cast back to ``x.dtype``, as in the reference.
    """
    num_prefix = x.shape[-2] - sin.shape[-2]
    if num_prefix < 0:
        raise ValueError(f"{x.shape[-2]} tokens but {sin.shape[-2]} RoPE rows")
    prefix, patches = x.split((num_prefix, sin.shape[-2]), dim=-2)
    patches = patches.to(sin.dtype)
    rotated = patches * cos + rotate_half(patches) * sin
    return torch.cat((prefix, rotated.to(x.dtype)), dim=-2)
