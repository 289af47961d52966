"""Collapse monitors of self-distillation, logged every step, and the verdict a run ends with.

Self-distillation fails in two known ways: the teacher goes uniform (every target the same flat
distribution, the CLS loss pinned at ln K) or every image maps to one embedding (the student's CLS
features stop varying across the batch). Each monitor is a cheap statistic of tensors the step has
already computed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# A teacher within this many nats of the uniform entropy ln K carries almost no information.
UNIFORM_MARGIN_NATS = 1.0
# Per-dimension std of L2-normalised features, times sqrt(D): ~1 for spread features, 0 for one point.
MIN_FEATURE_STD = 0.1


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Mean over rows of H(p) in nats."""
    p = probs.float()
    return -(p * torch.log(p.clamp_min(1e-12))).sum(dim=-1).mean()


def marginal_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy of the batch-mean distribution: ln of roughly how many prototypes are in use."""
    return entropy(probs.float().mean(dim=0, keepdim=True))


def agreement(student_logits: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """Share of samples whose student argmax prototype equals the teacher's."""
    return (student_logits.argmax(dim=-1) == teacher_probs.argmax(dim=-1)).float().mean()


def feature_std(features: torch.Tensor) -> torch.Tensor:
    """Std across the batch of L2-normalised features, averaged over dimensions, times sqrt(D)."""
    x = F.normalize(features.float(), dim=-1)
    return x.std(dim=0).mean() * math.sqrt(x.shape[-1])


def collapse_verdict(teacher_entropy: float, cls_std: float, num_prototypes: int) -> str | None:
    """Why the run counts as collapsed, or None when it does not."""
    uniform = math.log(num_prototypes)
    if teacher_entropy > uniform - UNIFORM_MARGIN_NATS:
        return (f"uniform teacher: entropy {teacher_entropy:.2f} nats is within "
                f"{UNIFORM_MARGIN_NATS:g} of ln({num_prototypes}) = {uniform:.2f}")
    if cls_std < MIN_FEATURE_STD:
        return f"one embedding: student CLS std {cls_std:.3f} < {MIN_FEATURE_STD:g}"
    return None
