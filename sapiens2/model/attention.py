"""Grouped-query self-attention with QK-norm, 2D RoPE and LayerScale."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sapiens2.model.norm import RMSNorm
from sapiens2.model.rope import apply_rope


class LayerScale(nn.Module):
    """Per-channel scale of a residual branch (``weight`` starts at ``init_value``)."""

    def __init__(self, dim: int, init_value: float) -> None:
        super().__init__()
        self.init_value = init_value
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, self.init_value)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class GroupedQueryAttention(nn.Module):
    """Multi-head self-attention with ``num_kv_heads`` key/value heads.

    Separate biased q/k/v projections; one RMSNorm over the head dim for q and one for k,
    shared across heads and applied after the head split and before RoPE. With fewer
    key/value heads, query head h reads key/value head ``h // (num_heads // num_kv_heads)``
    (``repeat_interleave``), the grouping the reference weights were trained with. The output
    projection is followed by the LayerScale ``gamma`` of the attention branch.

    The 4K tokenizer's local blocks are plain multi-head attention: ``qk_norm=False`` and
    ``layer_scale_init=None`` leave out the norms and ``gamma`` (and their state-dict entries).
    """

    def __init__(
        self, dim: int, num_heads: int, num_kv_heads: int, layer_scale_init: float | None = 1e-4,
        norm_eps: float = 1e-6, qk_norm: bool = True,
    ) -> None:
        super().__init__()
        if dim % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"bad heads: dim={dim}, heads={num_heads}, kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = dim // num_heads
        kv_dim = num_kv_heads * self.head_dim
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, kv_dim)
        self.wv = nn.Linear(dim, kv_dim)
        self.q_norm = RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        scaled = layer_scale_init is not None
        self.gamma = LayerScale(dim, layer_scale_init) if scaled else nn.Identity()

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """x: (B, N, dim); rope: (sin, cos) for the trailing patch tokens (see apply_rope)."""
        batch, tokens, dim = x.shape
        q = self.wq(x).view(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            # Rotating before the K repeat is cheaper and gives the same result.
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.num_kv_heads != self.num_heads:
            group = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2).reshape(batch, tokens, dim)
        return self.gamma(self.proj(out))
