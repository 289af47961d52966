"""DINO self-distillation on the CLS token: projection head, teacher centring, cross-entropy."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class DINOHead(nn.Module):
    """3-layer MLP -> L2-normalised bottleneck -> weight-normalised prototypes.

    The prototype matrix is normalised row-wise at every call, which is weight normalisation with
    the gain fixed to 1 (DINO's ``norm_last_layer=True``), written out so that it stays a single
    plain parameter for EMA and ZeRO partitioning.
    """

    def __init__(
        self, in_dim: int, out_dim: int, hidden_dim: int = 2048, bottleneck_dim: int = 256
    ) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden_dim),
            nn.GELU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.GELU(),
            nn.Linear(hidden_dim, bottleneck_dim),
        )
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                nn.init.trunc_normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)
        self.prototypes = nn.Parameter(torch.empty(out_dim, bottleneck_dim))
        nn.init.trunc_normal_(self.prototypes, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.mlp(x), dim=-1)
        return F.linear(x, F.normalize(self.prototypes, dim=-1))


class TeacherCenter(nn.Module):
    """EMA of the teacher's mean logits, subtracted before sharpening to avoid collapse.

    ``update`` averages the batch centre over data-parallel ranks first, so every rank keeps the
    same centre. Being a module, it checkpoints through ``state_dict``/``load_state_dict``.
    """

    center: torch.Tensor

    def __init__(self, out_dim: int, momentum: float = 0.9) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    @torch.no_grad()
    def update(self, batch_center: torch.Tensor) -> None:
        batch_center = batch_center.detach().float().reshape(1, -1).clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(batch_center)
            batch_center /= dist.get_world_size()
        self.center.mul_(self.momentum).add_(batch_center, alpha=1 - self.momentum)

    def extra_repr(self) -> str:
        return f"out_dim={self.center.shape[1]}, momentum={self.momentum}"


def dino_cross_entropy(
    student_logits: torch.Tensor, teacher_probs: torch.Tensor, student_temp: float
) -> torch.Tensor:
    """Mean over the batch of H(teacher, softmax(student / student_temp))."""
    log_probs = F.log_softmax(student_logits.float() / student_temp, dim=-1)
    return -(teacher_probs * log_probs).sum(dim=-1).mean()
