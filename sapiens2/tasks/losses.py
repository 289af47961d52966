"""Masked loss terms shared by the dense tasks; each name says what it computes.

Dense tensors are (B, C, H, W) and masks (B, H, W) bool. Every mean is over the masked pixels
(times channels), so background never contributes and the value does not depend on how much
of the image the person covers.
"""

from __future__ import annotations

import torch

from sapiens2.tasks.channels import channel_cosine


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of (B, C, H, W) or (B, H, W) values over the True pixels of a (B, H, W) mask."""
    if values.dim() == 3:
        values = values[:, None]
    weight = mask[:, None].to(values.dtype)
    count = weight.sum() * values.shape[1]
    return (values * weight).sum() / count.clamp_min(1.0)


def masked_l1(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean((pred - target).abs(), mask)


def cosine_distance(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of 1 - cos(pred, target) per pixel; pred need not be unit length."""
    cosine = channel_cosine(pred, target, eps=1e-6)
    return masked_mean(1.0 - cosine, mask)


def finite_differences(
    x: torch.Tensor, mask: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Horizontal and vertical forward differences, each with the mask of pairs fully inside."""
    dx = x[..., :, 1:] - x[..., :, :-1]
    dy = x[..., 1:, :] - x[..., :-1, :]
    return [(dx, mask[..., :, 1:] & mask[..., :, :-1]), (dy, mask[..., 1:, :] & mask[..., :-1, :])]


def gradient_l1(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """L1 distance between the image gradients of pred and target (gradient-difference loss)."""
    terms = [
        masked_l1(dp, dt, m)
        for (dp, m), (dt, _) in zip(
            finite_differences(pred, mask), finite_differences(target, mask), strict=True
        )
    ]
    return sum(terms) / len(terms)


def chromaticity(rgb: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """RGB divided by its channel sum: the colour with intensity removed."""
    rgb = rgb.clamp_min(0.0)
    return rgb / (rgb.sum(dim=1, keepdim=True) + eps)


def scale_invariant_log_loss(
    pred_depth: torch.Tensor,
    target_depth: torch.Tensor,
    mask: torch.Tensor,
    lam: float = 0.5,
    min_depth: float = 1e-3,
) -> torch.Tensor:
    """Eigen et al. scale-invariant log error: mean(d^2) - lam * mean(d)^2 with d = log ratio.

    Computed per image (the invariance is to one scale per image) and averaged over images that
    have masked pixels. Predictions are clamped positive because log needs them to be.
    """
    d = torch.log(pred_depth.clamp_min(min_depth)) - torch.log(target_depth.clamp_min(min_depth))
    weight = mask.to(d.dtype)
    count = weight.flatten(1).sum(1)
    mean_d = (d * weight).flatten(1).sum(1) / count.clamp_min(1.0)
    mean_d2 = (d.pow(2) * weight).flatten(1).sum(1) / count.clamp_min(1.0)
    per_image = mean_d2 - lam * mean_d.pow(2)
    valid = count > 0
    return per_image[valid].mean() if valid.any() else pred_depth.sum() * 0.0


def softmax_dice_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    exclude: tuple[int, ...] = (0,),
    smooth: float = 1.0,
) -> torch.Tensor:
    """1 - Dice between softmax probabilities and one-hot labels, averaged over classes.

    Sums run over every valid pixel of the batch; classes in `exclude` (background) are left
    out of the average so the large background region does not dominate.
    """
    num_classes = logits.shape[1]
    valid = target != ignore_index
    labels = target[valid]
    probs = logits.softmax(dim=1)
    prob_sums = (probs * valid[:, None]).sum(dim=(0, 2, 3))
    # The intersection needs only each valid pixel's probability of its own label, summed per
    # label: a gather and an index_add instead of a one-hot (B, C, H, W) tensor times the
    # probabilities (the loss's forward and backward 2x faster at 29 classes, 128x96, batch 8).
    own = probs.gather(1, torch.where(valid, target, 0)[:, None])[:, 0][valid]
    inter = probs.new_zeros(num_classes).index_add_(0, labels, own)
    label_counts = torch.bincount(labels, minlength=num_classes).to(probs.dtype)
    dice = (2 * inter + smooth) / (prob_sums + label_counts + smooth)
    keep = torch.ones(num_classes, dtype=torch.bool, device=logits.device)
    keep[list(exclude)] = False
    return (1.0 - dice[keep]).mean()
