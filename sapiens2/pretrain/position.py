"""Masked position prediction: an optional pretraining branch (MP3, Zhai et al. 2022).

A random subset of each global crop's patches enters the backbone with no position at all
(``forward_tokens(..., positions=False)``: RoPE is the backbone's only source of layout), and a
linear head names each token's cell on the patch grid. Backdrop patches are alike everywhere, so
the loss falls only by recognising what a patch shows of the body and where that sits relative
to the other visible patches: a head above a torso above the legs, the near arm on the side the
person faces. That is the part knowledge the part-correspondence probe and the pose head need,
and which the reconstruction and self-distillation terms did not build at the small recipes'
scale (the measurements are in ``benchmarks/results/recipe_screens.json``, ``position_prediction``).

L_position = cross-entropy over the grid cells, with label smoothing as in MP3 (a patch of plain
backdrop has no single right cell, so the target should not demand certainty about it).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

LABEL_SMOOTHING = 0.1


def draw_position_idx(batch: int, num_tokens: int, keep_ratio: float, generator: torch.Generator) -> torch.Tensor:
    """(batch, round(keep_ratio * num_tokens)) int64: a uniform random subset of the grid cells
    per sample, in random order (the blocks cannot tell the order; the head's targets can)."""
    keep = max(1, round(keep_ratio * num_tokens))
    return torch.rand(batch, num_tokens, generator=generator).argsort(dim=1)[:, :keep]


def position_loss(logits: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` (B, N, num_cells) against the true cells ``cells`` (B, N).
    A backbone that cannot place any patch scores ln(num_cells)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), cells.flatten(), label_smoothing=LABEL_SMOOTHING)


def encode_unplaced(backbone: nn.Module, images: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """The backbone's tokens (B, prefix + N, D) for the patches ``cells`` (B, N) of ``images``,
    encoded together but without positions."""
    return backbone.forward_tokens(images, cells, positions=False)


def position_logits(backbone: nn.Module, head: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The head's logits (B, N, num_cells) for ``encode_unplaced``'s patch tokens."""
    return head(tokens[:, backbone.num_prefix_tokens:])


def unseen_cells(cells: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(B, num_tokens - N) int64, ascending: the grid cells that ``cells`` (B, N) leaves out,
    which the MAE decoder reconstructs when it reads the position branch's pass."""
    seen = torch.zeros(cells.shape[0], num_tokens, dtype=torch.bool, device=cells.device)
    seen.scatter_(1, cells, True)
    # A stable sort puts the unseen cells (False) first, each row in grid order.
    return seen.to(torch.uint8).argsort(dim=1, stable=True)[:, : num_tokens - cells.shape[1]]
