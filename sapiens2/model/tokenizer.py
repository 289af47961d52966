"""Hierarchical 4K tokenizer: local blocks inside windows of patch tokens, pooled by window CLS."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.init import trunc_normal_
from torch.utils.checkpoint import checkpoint

from sapiens2.model.block import TransformerBlock


def window_partition(tokens: Tensor, grid: tuple[int, int], window: int) -> Tensor:
    """(B, h * w, D) row-major patch tokens -> (B, windows, window * window, D).

    Windows are numbered row-major on the (h / window, w / window) window grid, and the
    patches inside a window row-major too, so window n is token n of the pooled grid.
    """
    batch, _, dim = tokens.shape
    rows, cols = grid[0] // window, grid[1] // window
    x = tokens.view(batch, rows, window, cols, window, dim).transpose(2, 3)
    return x.reshape(batch, rows * cols, window * window, dim)


def window_patch_index(keep_idx: Tensor, grid: tuple[int, int], window: int) -> Tensor:
    """Patch indices (B, N_keep * window**2) of the windows ``keep_idx`` (B, N_keep) selects,
    in :func:`window_partition` order, so the patch embedding can skip masked windows."""
    cols = grid[1] // window
    offsets = torch.arange(window, device=keep_idx.device)
    inner = (offsets[:, None] * grid[1] + offsets[None, :]).flatten()  # (window**2,)
    corner = (keep_idx // cols) * window * grid[1] + (keep_idx % cols) * window
    return (corner[..., None] + inner).flatten(1)


class WindowTokenizer(nn.Module):
    """Runs ``depth`` local blocks in every window and keeps each window's CLS output.

    Per window: the shared learnable ``w_cls`` is prepended to the window's patch tokens, the
    learned ``local_pos_embed`` (1 + window**2 positions) is added, and the local blocks run
    (plain multi-head attention, no QK-norm, no RoPE, no LayerScale; SwiGLU). Windows do not
    interact, so they run as one batch, ``chunk`` windows at a time; in training each chunk is
    recomputed in the backward pass, which bounds the activation memory of a 4K image (49,152
    patch tokens) to one chunk's. Names match the reference (``tokenizer.w_cls``,
    ``tokenizer.local_pos_embed``, ``tokenizer.blocks.i.*``).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        ffn_hidden: int,
        depth: int,
        window: int = 4,
        chunk: int = 1024,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.window = window
        self.chunk = chunk
        self.local_pos_embed = nn.Parameter(torch.empty(1, 1 + window * window, dim))
        self.w_cls = nn.Parameter(torch.empty(1, 1, dim))
        self.blocks = nn.ModuleList(
            TransformerBlock(
                dim, num_heads, num_heads, ffn_hidden, None, norm_eps, qk_norm=False
            )
            for _ in range(depth)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The learned tokens only; the blocks' layers are initialised by the backbone."""
        trunc_normal_(self.local_pos_embed, std=0.02)
        trunc_normal_(self.w_cls, std=0.02)

    def _pool(self, windows: Tensor) -> Tensor:
        x = torch.cat((self.w_cls.expand(len(windows), -1, -1).to(windows.dtype), windows), dim=1)
        x = x + self.local_pos_embed.to(x.dtype)
        for block in self.blocks:
            x = block(x)
        return x[:, 0]

    def forward(self, windows: Tensor) -> Tensor:
        """(B, N_windows, window**2, D) patch tokens -> (B, N_windows, D) window tokens."""
        batch, count, size, dim = windows.shape
        if size != self.window * self.window:
            raise ValueError(f"expected {self.window}x{self.window} windows, got {size} tokens")
        recompute = self.training and torch.is_grad_enabled()
        pooled = [
            checkpoint(self._pool, chunk, use_reentrant=False) if recompute else self._pool(chunk)
            for chunk in windows.reshape(batch * count, size, dim).split(self.chunk)
        ]
        return torch.cat(pooled).view(batch, count, dim)
