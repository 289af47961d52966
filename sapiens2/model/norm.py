"""RMSNorm that keeps the activation dtype under mixed precision."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same ``weight`` parameter, eps 1e-6 by default) whose weight is cast to
    the input dtype.

    Under autocast the activations are bf16 while the weight stays fp32; plain
    ``nn.RMSNorm`` then leaves the fused kernel for a slower path and promotes its output to
    fp32, so every later layer would run on fp32 inputs. The fused kernel accumulates in fp32
    internally, so casting the weight costs no accuracy in the reduction.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)
