"""The Sapiens2 ViT backbone: one definition for every size in ``ARCHS``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn.init import trunc_normal_
from torch.utils.checkpoint import checkpoint

from sapiens2.model.attention import LayerScale
from sapiens2.model.block import TransformerBlock
from sapiens2.model.config import BackboneConfig, Output, resolve_config
from sapiens2.model.norm import RMSNorm
from sapiens2.model.patch_embed import PatchEmbed
from sapiens2.model.rope import RopePositionEmbedding
from sapiens2.model.tokenizer import WindowTokenizer, window_partition, window_patch_index


class Sapiens2Backbone(nn.Module):
    """Patch embedding, CLS + storage tokens, RoPE transformer blocks and a final RMSNorm.

    Parameter names and shapes equal the reference release (``cls_token``,
    ``storage_tokens``, ``patch_embed.projection``, ``rope_embed.periods``, ``blocks.i.*``,
    and ``ln1`` for the final norm), so published checkpoints load strictly.

    With ``config.tokenizer_blocks`` > 0 (the 4K variant) a :class:`WindowTokenizer` pools each
    window of patch tokens into one token before the global blocks, so the global grid, the
    RoPE table, ``keep_idx`` and the feature map are all on the pooled grid.
    ``patch_size`` is the pixels per side of one output token (``config.token_stride``), which
    is what masking and MAE targets need; the patch embedding keeps its own 16-px patch.
    """

    def __init__(self, config: BackboneConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_dim = config.embed_dim
        self.patch_size = config.token_stride
        self.depth = config.depth
        self.num_prefix_tokens = config.num_prefix_tokens
        dim = config.embed_dim
        self.cls_token = nn.Parameter(torch.empty(1, 1, dim))
        self.storage_tokens = nn.Parameter(torch.empty(1, config.num_storage_tokens, dim))
        self.patch_embed = PatchEmbed(config.in_channels, dim, config.patch_size)
        self.rope_embed = RopePositionEmbedding(
            config.head_dim, config.rope_base, config.rope_dtype
        )
        self.tokenizer = None
        if config.tokenizer_blocks:
            self.tokenizer = WindowTokenizer(
                dim,
                config.num_heads,
                config.ffn_hidden,
                config.tokenizer_blocks,
                config.window_size,
                config.window_chunk,
                config.norm_eps,
            )
        self.blocks = nn.ModuleList(
            TransformerBlock(
                dim,
                config.num_heads,
                config.kv_heads(i),
                config.ffn_hidden,
                config.layer_scale_init,
                config.norm_eps,
            )
            for i in range(config.depth)
        )
        self.ln1 = RMSNorm(dim, eps=config.norm_eps)  # final norm; the reference's name
        self._checkpointed = config.checkpointed_blocks()
        self.init_weights()

    def init_weights(self) -> None:
        """trunc_normal(0.02) tokens and Linear/Conv weights, zero biases, unit norms,
        LayerScale at its init value."""
        trunc_normal_(self.cls_token, std=0.02)
        trunc_normal_(self.storage_tokens, std=0.02)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(
                module, (nn.RMSNorm, LayerScale, RopePositionEmbedding, WindowTokenizer)
            ):
                module.reset_parameters()

    def forward_tokens(self, images: Tensor, keep_idx: Tensor | None = None, positions: bool = True) -> Tensor:
        """Encodes ``images`` (B, C, H, W) into normed tokens (B, prefix + N, D).

        ``keep_idx`` (B, N_keep) int64 selects the visible patches (row-major indices on the
        patch grid): only those tokens enter the blocks, each rotated by the RoPE of its true
        position, so masked patches cost nothing and cannot leak into the output. The prefix
        tokens (CLS, then storage tokens) are always kept. For the 4K variant the indices are
        on the pooled (window) grid.

        ``positions=False`` gives every token the identity rotation: RoPE is the backbone's only
        source of global position, so the blocks then see a set of patches with no layout (the
        position-prediction pretext, ``sapiens2.pretrain.position``).
        """
        batch = images.shape[0]
        if keep_idx is not None and (
            keep_idx.ndim != 2 or keep_idx.shape[0] != batch or keep_idx.dtype != torch.long
        ):
            raise ValueError(
                f"keep_idx must be int64 (B={batch}, N_keep), "
                f"got {keep_idx.dtype} {tuple(keep_idx.shape)}"
            )
        x, grid = self._embed(images, keep_idx)
        sin, cos = self.rope_embed(grid)
        if keep_idx is not None:
            # (B, 1, N_keep, d): one table per sample, broadcast over heads.
            sin, cos = sin[keep_idx].unsqueeze(1), cos[keep_idx].unsqueeze(1)
        if not positions:
            sin, cos = torch.zeros_like(sin), torch.ones_like(cos)
        prefix = torch.cat(
            (self.cls_token.expand(batch, -1, -1), self.storage_tokens.expand(batch, -1, -1)), dim=1
        )
        x = torch.cat((prefix.to(x.dtype), x), dim=1)
        recompute = self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if recompute and i in self._checkpointed:
                x = checkpoint(block, x, (sin, cos), use_reentrant=False)
            else:
                x = block(x, (sin, cos))
        return self.ln1(x)

    def _embed(self, images: Tensor, keep_idx: Tensor | None) -> tuple[Tensor, tuple[int, int]]:
        """Tokens of the visible grid positions (B, N, D) and the grid the blocks see."""
        if self.tokenizer is None:
            return self.patch_embed(images, keep_idx)
        window, stride = self.tokenizer.window, self.patch_size
        height, width = images.shape[-2:]
        if height % stride or width % stride:
            raise ValueError(
                f"image size {height}x{width} is not a multiple of the {stride}-px window"
            )
        patch_grid = (height // self.patch_embed.patch_size, width // self.patch_embed.patch_size)
        if keep_idx is None:
            x, _ = self.patch_embed(images)
            windows = window_partition(x, patch_grid, window)
        else:
            # Windows never see each other, so dropping masked ones before the local stage gives
            # the same visible tokens as dropping them after it, for the visible share of the cost.
            x, _ = self.patch_embed(images, window_patch_index(keep_idx, patch_grid, window))
            windows = x.view(x.shape[0], keep_idx.shape[1], window * window, x.shape[-1])
        return self.tokenizer(windows), (height // stride, width // stride)

    def forward(self, images: Tensor, output: Output | None = None) -> Tensor:
        """``featmap`` (B, D, H/s, W/s) by default, s = ``patch_size`` (16, or 64 for 4K), or
        ``tokens`` (B, prefix + N, D) or ``cls`` (B, D)."""
        output = output or self.config.output
        if output not in ("featmap", "tokens", "cls"):
            raise ValueError(f"output must be 'featmap', 'tokens' or 'cls', got {output!r}")
        tokens = self.forward_tokens(images)
        if output == "tokens":
            return tokens
        if output == "cls":
            return tokens[:, 0]
        grid = (images.shape[-2] // self.patch_size, images.shape[-1] // self.patch_size)
        patches = tokens[:, self.num_prefix_tokens :]
        return patches.transpose(1, 2).reshape(tokens.shape[0], self.embed_dim, *grid)

    def no_weight_decay(self) -> set[str]:
        """Multi-dimensional parameters exempt from weight decay (the learned tokens).

        Norm weights, LayerScale and biases are 1-D and left to the optimiser's 1-D rule.
        """
        tokens = {"cls_token", "storage_tokens"}
        if self.tokenizer is not None:
            tokens |= {"tokenizer.w_cls", "tokenizer.local_pos_embed"}
        return tokens

    def layer_id(self, name: str) -> int:
        """Depth index of a parameter for layer-wise lr decay: 0 for the patch embedding, tokens
        and 4K tokenizer, i + 1 for ``blocks.i.*``, depth + 1 for the final norm."""
        embedding = ("cls_token", "storage_tokens", "patch_embed.", "rope_embed.", "tokenizer.")
        if name.startswith(embedding):
            return 0
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        if name.startswith("ln1."):
            return self.depth + 1
        raise ValueError(f"{name!r} is not a parameter of the Sapiens2 backbone")


def build_backbone(
    name: str, img_size: Sequence[int] | None = None, **overrides
) -> Sapiens2Backbone:
    """Builds ``ARCHS[name]`` with ``img_size`` (H, W) and field overrides, e.g.
    ``rope_dtype="fp32"``, ``grad_checkpointing=[0, 1]``, ``output="tokens"`` or
    ``tokenizer_blocks=4`` (the 4K tokenizer on any size; ``sapiens2_1b_4k`` names it)."""
    return Sapiens2Backbone(resolve_config(name, img_size, **overrides))
