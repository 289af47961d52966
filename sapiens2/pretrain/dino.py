"""Self-distillation heads and loss: the projection head with prototypes, and the cross-entropy.

One head definition serves both distillation terms: the CLS (sparse) term and the masked-patch
(dense, iBOT) term each own one, with their own prototypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Parameter name of the prototype matrix: frozen at the start of a run and never weight-decayed.
PROTOTYPES = "prototypes"


class DINOHead(nn.Module):
    """3-layer MLP -> L2-normalised bottleneck -> weight-normalised prototypes.

    The prototype matrix is normalised row-wise at every call: weight normalisation with the gain
    fixed to 1 (DINO's ``norm_last_layer=True``), written out so that it stays a single plain
    parameter for EMA and ZeRO partitioning. Because only its direction matters, weight decay on
    it would only shrink its norm and inflate its effective step size; the trainer exempts it
    (``PROTOTYPES``) and keeps it frozen for the first part of the run.
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


def dino_cross_entropy(
    student_logits: torch.Tensor, teacher_probs: torch.Tensor, student_temp: float
) -> torch.Tensor:
    """Mean over rows of H(teacher, softmax(student / student_temp))."""
    log_probs = F.log_softmax(student_logits.float() / student_temp, dim=-1)
    return -(teacher_probs * log_probs).sum(dim=-1).mean()
