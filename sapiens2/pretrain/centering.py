"""Teacher centring: turning teacher logits into targets that cannot collapse.

Two options (``ObjectiveConfig.centering``): Sinkhorn-Knopp (DINOv3, the default), which makes the
batch's assignments to prototypes equipartitioned, and DINO's EMA centre subtracted before
sharpening. Both reduce over data-parallel ranks, so every rank computes the same targets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if _distributed():
        dist.all_reduce(tensor)
    return tensor


@torch.no_grad()
def sinkhorn_knopp(logits: torch.Tensor, temp: float, iterations: int = 3) -> torch.Tensor:
    """Targets (N, K) whose rows sum to 1 and whose prototype totals over the global batch are
    equal: alternate normalisation of Q = exp(logits / temp) over prototypes and samples.

    ``N`` is the local number of samples; sums over samples include every rank.
    """
    q = (logits.float() / temp).T  # (K, N)
    # One shift for every rank keeps exp() finite; it cancels in the first normalisation.
    shift = q.max().reshape(1)
    if _distributed():
        dist.all_reduce(shift, op=dist.ReduceOp.MAX)
    q = torch.exp(q - shift)
    n_local = torch.tensor([q.shape[1]], dtype=torch.float32, device=q.device)
    n_total = _all_reduce_sum(n_local.clone())
    k = q.shape[0]
    q /= _all_reduce_sum(q.sum().reshape(1))
    for _ in range(iterations):
        q /= _all_reduce_sum(q.sum(dim=1, keepdim=True)) * k  # each prototype gets 1/K
        q /= q.sum(dim=0, keepdim=True) * n_total  # each sample gets 1/N
    return (q * n_total).T


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


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
        batch_center = _all_reduce_sum(batch_center.to(self.center.device)) / _world()
        self.center.mul_(self.momentum).add_(batch_center, alpha=1 - self.momentum)

    @torch.no_grad()
    def targets(self, logits: torch.Tensor, temp: float) -> torch.Tensor:
        return torch.softmax((logits.float() - self.center) / temp, dim=-1)

    def extra_repr(self) -> str:
        return f"out_dim={self.center.shape[1]}, momentum={self.momentum}"


class Centering(nn.Module):
    """Teacher logits -> distillation targets for the CLS and the patch prototypes.

    ``kind="sinkhorn_knopp"`` equipartitions each batch (no state); ``kind="ema"`` subtracts
    DINO's EMA centres, which ``update`` moves once per optimizer step with the means of the
    logits it has seen since the last update. Being a module, the centres checkpoint through
    ``state_dict``.
    """

    def __init__(self, kind: str, cls_dim: int, patch_dim: int | None = None,
                 momentum: float = 0.9, iterations: int = 3) -> None:
        super().__init__()
        if kind not in ("sinkhorn_knopp", "ema"):
            raise ValueError(f"unknown centering {kind!r}; expected 'sinkhorn_knopp' or 'ema'")
        self.kind, self.iterations = kind, iterations
        self.cls = TeacherCenter(cls_dim, momentum)
        self.patch = TeacherCenter(patch_dim, momentum) if patch_dim else None
        self._seen: dict[str, list[torch.Tensor]] = {"cls": [], "patch": []}

    @torch.no_grad()
    def targets(self, logits: torch.Tensor, temp: float, which: str = "cls") -> torch.Tensor:
        """(N, K) logits -> (N, K) target probabilities."""
        if self.kind == "sinkhorn_knopp":
            return sinkhorn_knopp(logits, temp, self.iterations)
        self._seen[which].append(logits.float().mean(dim=0))
        center = self.cls if which == "cls" else self.patch
        return center.targets(logits, temp)

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: move the EMA centres (a no-op for Sinkhorn-Knopp)."""
        for which, center in (("cls", self.cls), ("patch", self.patch)):
            seen = self._seen[which]
            if seen and center is not None:
                center.update(torch.stack(seen).mean(dim=0))
            seen.clear()
