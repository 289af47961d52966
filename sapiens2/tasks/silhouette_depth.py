"""The small pointmap head's global path: a prior canonical map fitted to the train labels, and a
per-image XYZ offset read off the silhouette the head predicts.

Why (plain loop, demo split, scratch, 200 steps): the per-pixel mean of the train canonical maps
scores 0.223 on val, and most of that error is each image's depth offset (0.095 once an oracle
shifts Z per image). That offset is the person's pixel height in disguise: canonical Z is
f_canonical x body height / pixel height (correlation 0.86 with 1 / pixel height; a fit on it
alone gives 0.134). No linear read of the tokens or pixels finds it (ridge R^2 about 0), and the
decoder alone learned none of it (the std over images of its mean predicted Z was 0.001 against
0.23 in the labels). So the head predicts a silhouette, reads its row and column extents, and a
small MLP turns them into an offset, while the decoder adds a residual to the prior: the first
prediction is the train mean map, the strongest trivial pointmap, and the model learns from there
(`benchmarks/recipe_calibration.py`, val canonical L2: 0.221 at 70 steps, 0.213 at 150, 0.173 at
200; the mean map 0.223; the decoder alone 0.272 at 200). The silhouette takes ~150 steps to form,
so 70 steps tie the mean map. A fitted depth-vs-height law on the predicted silhouette scored
worse (0.231 at 70, 0.200 at 200: early silhouettes are too rough to apply it at full strength).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

# The prior and the silhouette are read on this fixed grid, so the head's weights and buffers do
# not depend on the input size (the mean map is smooth: a 4x coarser grid than 128x96 loses little).
PRIOR_GRID = (32, 24)
# The decoder's residual is scaled down: the canonical map varies by tenths around the prior.
RESIDUAL_SCALE = 0.1


def prior_on_grid(mean_map: torch.Tensor) -> torch.Tensor:
    """A (3, H, W) mean canonical map resampled (area average) to the head's `PRIOR_GRID`."""
    return F.interpolate(mean_map[None].float(), size=PRIOR_GRID, mode="area")[0]


def prior_at(prior: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The (3, *PRIOR_GRID) prior upsampled to an output of `size`, with a batch axis."""
    return F.interpolate(prior[None], size=size, mode="bilinear", align_corners=False)


class SilhouetteOffset(nn.Module):
    """Per-image XYZ offset (B, 3) from a silhouette probability map (B, H, W).

    Features: the silhouette's occupancy of each grid row and column (where the person starts and
    ends) plus the inverses of its height and width fractions (canonical depth goes as 1 / pixel
    height). The silhouette is detached: the offset reads it and does not reshape it. The last
    layer starts at zero, so an untrained branch leaves the prior alone.
    """

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        rows, cols = PRIOR_GRID
        self.mlp = nn.Sequential(nn.Linear(rows + cols + 2, hidden), nn.SiLU(), nn.Linear(hidden, 3))
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, silhouette: torch.Tensor) -> torch.Tensor:
        grid = F.adaptive_avg_pool2d(silhouette.detach()[:, None], PRIOR_GRID)[:, 0]
        rows, cols = grid.amax(dim=2), grid.amax(dim=1)
        height, width = rows.mean(1, keepdim=True), cols.mean(1, keepdim=True)
        inverse_extent = torch.cat([1.0 / height.clamp_min(0.2), 0.1 / width.clamp_min(0.1)], dim=1)
        return self.mlp(torch.cat([rows, cols, inverse_extent], dim=1))
