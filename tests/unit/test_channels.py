"""Per-pixel vector algebra over channels: the same maps as torch's reference functions, and
finite gradients where a vector is zero (the background of a normal map)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from sapiens2.tasks.channels import channel_cosine, channel_cross, channel_norm, unit_channels


def fields(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    b = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    a[0, :, 1, 2] = 0.0  # a zero vector, as on a zeroed background
    b[1, :, 3, 0] = 1e-9  # shorter than the eps below
    return a, b


def test_norm_unit_cosine_and_cross_match_torch():
    a, b = fields()
    torch.testing.assert_close(channel_norm(a), a.norm(dim=1), rtol=1e-12, atol=1e-15)
    for eps in (1e-12, 1e-6):
        torch.testing.assert_close(unit_channels(b, eps), F.normalize(b, dim=1, eps=eps), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(channel_cosine(a, b, eps), F.cosine_similarity(a, b, dim=1, eps=eps),
                                   rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(channel_cross(a, b), torch.linalg.cross(a, b, dim=1), rtol=1e-12, atol=1e-15)
    swapped = channel_cross(b, a)
    torch.testing.assert_close(swapped, -channel_cross(a, b))  # order matters: a x b = -(b x a)


def test_gradients_are_finite_at_zero_vectors_and_match_torch_elsewhere():
    a, b = fields()
    a.requires_grad_(True)
    (grad,) = torch.autograd.grad(channel_cosine(a, b, 1e-6).sum(), a)
    assert torch.isfinite(grad).all()
    a_ref = a.detach().clone().requires_grad_(True)
    (grad_ref,) = torch.autograd.grad(F.cosine_similarity(a_ref, b, dim=1, eps=1e-6).sum(), a_ref)
    nonzero = a.detach().norm(dim=1, keepdim=True).expand_as(a) > 1e-6
    torch.testing.assert_close(grad[nonzero], grad_ref[nonzero], rtol=1e-10, atol=1e-12)
    (grad_unit,) = torch.autograd.grad(unit_channels(a, 1e-6).sum(), a)
    assert torch.isfinite(grad_unit).all()
