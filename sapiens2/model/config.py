"""Backbone size table: one frozen config per architecture, looked up in ``ARCHS``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

RopeDtype = Literal["bf16", "fp32"]
Output = Literal["featmap", "tokens", "cls"]


@dataclass(frozen=True)
class BackboneConfig:
    """Hyper-parameters of one Sapiens2 ViT.

    Blocks ``[0, full_attention_blocks)`` and the last ``full_attention_blocks`` blocks use full
    multi-head attention; every block in between uses ``num_kv_heads`` key/value heads (GQA).
    ``grad_checkpointing`` is ``True`` (all blocks), ``False`` or a tuple of block ids whose
    activations are recomputed in the backward pass.

    ``tokenizer_blocks`` > 0 selects the hierarchical 4K variant: that many local blocks run in
    each ``window_size`` x ``window_size`` window of patch tokens, ``window_chunk`` windows at a
    time, and each window's CLS output becomes one token of the grid the global blocks see.
    """

    embed_dim: int
    depth: int
    num_heads: int
    num_kv_heads: int
    full_attention_blocks: int = 8
    ffn_ratio: int = 4
    patch_size: int = 16
    in_channels: int = 3
    num_storage_tokens: int = 8
    img_size: tuple[int, int] = (1024, 768)
    rope_base: float = 100.0
    rope_dtype: RopeDtype = "bf16"
    layer_scale_init: float = 1e-4
    norm_eps: float = 1e-6
    output: Output = "featmap"
    grad_checkpointing: bool | tuple[int, ...] = False
    tokenizer_blocks: int = 0
    window_size: int = 4
    window_chunk: int = 1024

    def __post_init__(self) -> None:
        if self.embed_dim % (4 * self.num_heads):
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must be divisible by 4 * num_heads "
                f"({4 * self.num_heads}) for 2D RoPE"
            )
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if self.full_attention_blocks < 0:
            raise ValueError(
                f"full_attention_blocks must be >= 0, got {self.full_attention_blocks}"
            )
        if self.rope_dtype not in ("bf16", "fp32"):
            raise ValueError(f"rope_dtype must be 'bf16' or 'fp32', got {self.rope_dtype!r}")
        if self.output not in ("featmap", "tokens", "cls"):
            raise ValueError(f"output must be 'featmap', 'tokens' or 'cls', got {self.output!r}")
        if self.tokenizer_blocks < 0 or self.window_size < 1 or self.window_chunk < 1:
            raise ValueError(
                f"need tokenizer_blocks >= 0, window_size >= 1 and window_chunk >= 1, got "
                f"{self.tokenizer_blocks}, {self.window_size}, {self.window_chunk}"
            )
        height, width = self.img_size
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"img_size {self.img_size} must be divisible by patch_size {self.patch_size}"
            )
        if height % self.token_stride or width % self.token_stride:
            raise ValueError(
                f"img_size {self.img_size} must be divisible by the {self.token_stride}-px "
                f"window of the 4K tokenizer"
            )
        if not isinstance(self.grad_checkpointing, bool):
            bad = [i for i in self.grad_checkpointing if not 0 <= i < self.depth]
            if bad:
                raise ValueError(
                    f"grad_checkpointing block ids {bad} out of range [0, {self.depth})"
                )

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_ratio * self.embed_dim

    @property
    def num_prefix_tokens(self) -> int:
        """CLS token plus storage (register) tokens, prepended in that order."""
        return 1 + self.num_storage_tokens

    @property
    def token_stride(self) -> int:
        """Pixels per side of the image area one output token stands for: the patch, or for
        the 4K variant the pooled window of patches."""
        return self.patch_size * (self.window_size if self.tokenizer_blocks else 1)

    @property
    def grid_size(self) -> tuple[int, int]:
        """Token grid of the global blocks and of the feature map."""
        return self.img_size[0] // self.token_stride, self.img_size[1] // self.token_stride

    def kv_heads(self, block: int) -> int:
        """Key/value heads of block ``block``: all heads at both ends, GQA in the middle."""
        ends = self.full_attention_blocks
        return self.num_heads if block < ends or block >= self.depth - ends else self.num_kv_heads

    def checkpointed_blocks(self) -> frozenset[int]:
        if isinstance(self.grad_checkpointing, bool):
            return frozenset(range(self.depth)) if self.grad_checkpointing else frozenset()
        return frozenset(self.grad_checkpointing)


def _arch(embed_dim: int, depth: int, num_heads: int, **kwargs) -> BackboneConfig:
    # The reference halves the key/value heads in every middle block.
    return BackboneConfig(embed_dim, depth, num_heads, num_kv_heads=num_heads // 2, **kwargs)


_BASE: dict[str, BackboneConfig] = {
    "sapiens2_0.1b": _arch(768, 12, 12),
    "sapiens2_0.4b": _arch(1024, 24, 16),
    "sapiens2_0.8b": _arch(1280, 32, 16),
    "sapiens2_1b": _arch(1536, 40, 24),
    "sapiens2_5b": _arch(2432, 56, 32),
    # Small configs for CPU tests and the demo; same structure, GQA in the middle blocks.
    # LayerScale starts at 0.1, not the published 1e-4: a randomly initialised 4-6 block model
    # trained for minutes would otherwise keep its attention, and so its CLS token, almost
    # independent of the image (the CLS distillation collapsed to a uniform teacher with 1e-4).
    "sapiens2_tiny": _arch(128, 6, 4, full_attention_blocks=2, layer_scale_init=0.1),
    "sapiens2_debug": _arch(64, 4, 2, full_attention_blocks=1, layer_scale_init=0.1),
}
# Local blocks of the 4K tokenizer per size (paper); the 4K models default to 4096x3072 input.
LOCAL_BLOCKS = {
    "sapiens2_0.1b": 2,
    "sapiens2_0.4b": 2,
    "sapiens2_0.8b": 3,
    "sapiens2_1b": 4,
    "sapiens2_5b": 6,
    "sapiens2_tiny": 2,
    "sapiens2_debug": 2,
}

ARCHS: dict[str, BackboneConfig] = {
    **_BASE,
    **{
        f"{name}_4k": replace(_BASE[name], tokenizer_blocks=blocks, img_size=(4096, 3072))
        for name, blocks in LOCAL_BLOCKS.items()
    },
}


def resolve_config(name: str, img_size: Sequence[int] | None = None, **overrides) -> BackboneConfig:
    """``ARCHS[name]`` with ``img_size`` and any field overridden (unknown fields raise)."""
    if name not in ARCHS:
        raise KeyError(f"unknown backbone {name!r}; known: {sorted(ARCHS)}")
    base = ARCHS[name]
    fields = set(base.__dataclass_fields__)
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown backbone option(s) {unknown}; valid: {sorted(fields)}")
    if img_size is not None:
        overrides["img_size"] = tuple(int(s) for s in img_size)
    checkpointing = overrides.get("grad_checkpointing")
    if checkpointing is not None and not isinstance(checkpointing, bool):
        # A list from YAML/CLI becomes a tuple so the config stays hashable.
        overrides["grad_checkpointing"] = tuple(int(i) for i in checkpointing)
    return replace(base, **overrides)
