"""Pre-norm transformer block and its SwiGLU feed-forward layer."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from sapiens2.model.attention import GroupedQueryAttention
from sapiens2.model.norm import RMSNorm


class SwiGLUFFN(nn.Module):
    """``w3(silu(a) * b)`` with ``[a, b] = w12(x)``; biases on both projections.

    The hidden width is used as given (Sapiens2 uses 4 * dim, without the 2/3 scaling other
    SwiGLU models apply to match the parameter count of a GELU MLP).
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        gate, value = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * value)


class TransformerBlock(nn.Module):
    """``x + attn(ln1(x))`` then ``x + ffn(ln2(x))``.

    LayerScale sits on the attention branch only (inside ``attn.gamma``); the FFN branch is
    unscaled, as in the reference. The 4K tokenizer reuses this block without QK-norm,
    LayerScale or RoPE (see :class:`GroupedQueryAttention`).
    """

    def __init__(
        self, dim: int, num_heads: int, num_kv_heads: int, ffn_hidden: int,
        layer_scale_init: float | None = 1e-4, norm_eps: float = 1e-6, qk_norm: bool = True,
    ) -> None:
        super().__init__()
        self.ln1 = RMSNorm(dim, eps=norm_eps)
        self.attn = GroupedQueryAttention(
            dim, num_heads, num_kv_heads, layer_scale_init, norm_eps, qk_norm
        )
        self.ln2 = RMSNorm(dim, eps=norm_eps)
        self.ffn = SwiGLUFFN(dim, ffn_hidden)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        x = x + self.attn(self.ln1(x), rope)
        return x + self.ffn(self.ln2(x))
