"""Masked-autoencoder branch: patchify, normalised-pixel targets, light decoder and loss.

The encoder only sees visible patches; the decoder receives their tokens at their 2D positions
plus one shared mask token at every masked position and predicts the masked patches' pixels.
Targets are the MAE convention: each patch normalised by its own mean and variance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, p*p*C), patches row-major, pixels (row, col, channel) inside."""
    b, c, height, width = images.shape
    h, w = height // patch_size, width // patch_size
    x = images.reshape(b, c, h, patch_size, w, patch_size)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(b, h * w, patch_size * patch_size * c)


def unpatchify(patches: torch.Tensor, grid: tuple[int, int], patch_size: int) -> torch.Tensor:
    """Inverse of :func:`patchify`: (B, N, p*p*C) on an (h, w) grid -> (B, C, h*p, w*p)."""
    b, _, dim = patches.shape
    h, w = grid
    c = dim // (patch_size * patch_size)
    x = patches.reshape(b, h, w, patch_size, patch_size, c)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(b, c, h * patch_size, w * patch_size)


def normalized_pixel_targets(patches: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-patch normalisation: zero mean and unit variance over each patch's pixels."""
    mean = patches.mean(dim=-1, keepdim=True)
    var = patches.var(dim=-1, keepdim=True, unbiased=False)
    return (patches - mean) / torch.sqrt(var + eps)


def sincos_pos_embed_2d(grid: tuple[int, int], dim: int) -> torch.Tensor:
    """Fixed 2D sine-cosine position embedding (N, dim): half the width per axis (MAE)."""
    h, w = grid
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    rows, cols = torch.meshgrid(
        torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij"
    )
    parts = []
    for coord in (rows.flatten(), cols.flatten()):
        angles = coord[:, None] * omega[None, :]
        parts += [torch.sin(angles), torch.cos(angles)]
    return torch.cat(parts, dim=1).float()


class DecoderBlock(nn.Module):
    """Pre-norm transformer block (LayerNorm, multi-head attention, GELU MLP)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class MAEDecoder(nn.Module):
    """Light decoder predicting the pixels of masked patches from the encoder's visible tokens.

    ``forward(tokens, keep_idx, mask_idx, grid)`` takes the encoder output (B, P + N_keep, D)
    (P prefix tokens first, then visible patches in ``keep_idx`` order) and returns
    (B, N_mask, p*p*3) predictions in ``mask_idx`` order.
    """

    def __init__(
        self, encoder_dim: int, decoder_dim: int = 256, depth: int = 2, num_heads: int = 8,
        patch_size: int = 16, num_prefix_tokens: int = 9, in_chans: int = 3,
    ) -> None:
        super().__init__()
        self.decoder_dim = decoder_dim
        self.num_prefix_tokens = num_prefix_tokens
        self.embed = nn.Linear(encoder_dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))
        self.blocks = nn.ModuleList(DecoderBlock(decoder_dim, num_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(decoder_dim)
        self.pred = nn.Linear(decoder_dim, patch_size * patch_size * in_chans)
        self.apply(_init_weights)
        nn.init.trunc_normal_(self.mask_token, std=0.02)

    def forward_features(
        self, tokens: torch.Tensor, keep_idx: torch.Tensor, mask_idx: torch.Tensor, grid: tuple[int, int]
    ) -> torch.Tensor:
        """Normalised decoder states (B, N_mask, decoder_dim) at the masked positions: what the
        pixel predictor and the dense distillation predictor both read."""
        x = self.embed(tokens)
        pos = sincos_pos_embed_2d(grid, self.decoder_dim).to(x.device, x.dtype)
        prefix, visible = x[:, : self.num_prefix_tokens], x[:, self.num_prefix_tokens :]
        visible = visible + pos[keep_idx]
        masked = self.mask_token.expand(mask_idx.shape[0], mask_idx.shape[1], -1) + pos[mask_idx]
        x = torch.cat([prefix, visible, masked], dim=1)
        for block in self.blocks:
            x = block(x)
        return self.norm(x[:, -mask_idx.shape[1] :])

    def forward(
        self, tokens: torch.Tensor, keep_idx: torch.Tensor, mask_idx: torch.Tensor, grid: tuple[int, int]
    ) -> torch.Tensor:
        return self.pred(self.forward_features(tokens, keep_idx, mask_idx, grid))


def mae_loss(
    pred: torch.Tensor, images: torch.Tensor, mask_idx: torch.Tensor, patch_size: int, target: str = "normalized"
) -> torch.Tensor:
    """Mean squared error on the masked patches only, against `target` pixels: "normalized" per
    patch (MAE's choice), or the input's "pixels" as they are, whose patch brightness and contrast
    carry the shading an albedo or normal head reads and a per-patch normalisation discards.

    Targets are computed in float32 so that per-patch statistics stay exact under bf16 training.
    """
    patches = patchify(images.float(), patch_size)
    targets = normalized_pixel_targets(patches) if target == "normalized" else patches
    targets = targets.gather(1, mask_idx[..., None].expand(-1, -1, targets.shape[-1]))
    return F.mse_loss(pred.float(), targets)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
