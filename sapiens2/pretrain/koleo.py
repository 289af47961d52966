"""KoLeo regulariser (Kozachenko-Leonenko entropy estimate), as DINOv2 applies it to the student CLS.

Minimising -mean(log d_nn), the log distance of each L2-normalised feature to its nearest
neighbour in the batch, spreads the features uniformly over the sphere, which works against the
collapse of every image onto one embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def koleo_loss(features: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """-mean_i log(min_{j != i} ||f_i - f_j||) over a (N, D) batch of features (N >= 2)."""
    if features.shape[0] < 2:
        raise ValueError(f"koleo_loss needs at least 2 features, got {features.shape[0]}")
    x = F.normalize(features.float(), dim=-1, eps=eps)
    with torch.no_grad():
        similarity = x @ x.T
        similarity.fill_diagonal_(-2.0)  # never one's own neighbour
        nearest = similarity.argmax(dim=1)
    distances = F.pairwise_distance(x, x[nearest], eps=eps)
    return -torch.log(distances + eps).mean()
