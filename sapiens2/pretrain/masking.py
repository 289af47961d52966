"""MAE masks: mixed blockwise / patchwise masking with an exact masked count per sample."""

from __future__ import annotations

import math

import torch


class MaskGenerator:
    """Draws boolean masks on a patch grid, True = masked (hidden from the encoder).

    Every sample gets exactly ``round(N * mask_ratio)`` masked patches, so a batch can be turned
    into dense ``(B, N_keep)`` index tensors. With probability ``block_prob`` a sample is masked
    blockwise (random rectangles of random aspect, BEiT style), otherwise patchwise (a uniformly
    random subset). All randomness comes from the ``torch.Generator`` passed to ``__call__``.
    """

    def __init__(
        self,
        grid: tuple[int, int],
        mask_ratio: float = 0.75,
        block_prob: float = 0.4,
        min_block_patches: int = 4,
        aspect_range: tuple[float, float] = (0.3, 1 / 0.3),
    ) -> None:
        self.grid_h, self.grid_w = grid
        self.num_patches = self.grid_h * self.grid_w
        self.num_masked = round(self.num_patches * mask_ratio)
        if not 0 < self.num_masked < self.num_patches:
            raise ValueError(
                f"mask_ratio {mask_ratio} on a {self.grid_h}x{self.grid_w} grid masks "
                f"{self.num_masked} of {self.num_patches} patches; need at least one masked "
                "and one visible patch"
            )
        if not 0.0 <= block_prob <= 1.0:
            raise ValueError(f"block_prob must be in [0, 1], got {block_prob}")
        self.block_prob = block_prob
        self.min_block_patches = min_block_patches
        self.log_aspect = (math.log(aspect_range[0]), math.log(aspect_range[1]))

    def __call__(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        masks = torch.zeros(batch_size, self.num_patches, dtype=torch.bool)
        blockwise = torch.rand(batch_size, generator=generator) < self.block_prob
        for b in range(batch_size):
            if blockwise[b]:
                masks[b] = self._blockwise(generator).flatten()
            else:
                chosen = torch.randperm(self.num_patches, generator=generator)[: self.num_masked]
                masks[b, chosen] = True
        return masks

    def _uniform(self, low: float, high: float, generator: torch.Generator) -> float:
        return low + (high - low) * torch.rand((), generator=generator).item()

    def _randint(self, low: int, high: int, generator: torch.Generator) -> int:
        """Integer in [low, high] inclusive."""
        return int(torch.randint(low, high + 1, (), generator=generator))

    def _blockwise(self, generator: torch.Generator) -> torch.Tensor:
        mask = torch.zeros(self.grid_h, self.grid_w, dtype=torch.bool)
        count = 0
        # Rectangles overlapping the existing mask add few new patches; after this many misses in a
        # row the remainder is filled patchwise so the loop always ends.
        misses, max_misses = 0, 10
        while count < self.num_masked and misses < max_misses:
            remaining = self.num_masked - count
            low = min(self.min_block_patches, remaining)
            area = self._uniform(low, max(low, remaining), generator)
            aspect = math.exp(self._uniform(*self.log_aspect, generator))
            h = min(self.grid_h, max(1, round(math.sqrt(area * aspect))))
            w = min(self.grid_w, max(1, round(math.sqrt(area / aspect))))
            top = self._randint(0, self.grid_h - h, generator)
            left = self._randint(0, self.grid_w - w, generator)
            window = mask[top : top + h, left : left + w]
            new = (~window).nonzero()
            if len(new) == 0:
                misses += 1
                continue
            misses = 0
            # Keep only as many new patches as still needed, in raster order so the last block
            # stays contiguous instead of being thinned at random.
            new = new[:remaining]
            window[new[:, 0], new[:, 1]] = True
            count += len(new)
        if count < self.num_masked:
            free = (~mask.flatten()).nonzero().squeeze(1)
            pick = free[torch.randperm(len(free), generator=generator)[: self.num_masked - count]]
            mask.view(-1)[pick] = True
        return mask


def mask_to_indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a (B, N) boolean mask with an equal count per row into sorted index tensors.

    Returns ``keep_idx`` (B, N_keep) of the visible patches and ``mask_idx`` (B, N_mask) of the
    masked ones, each ascending (row-major on the patch grid), as the encoder expects.
    """
    counts = mask.sum(dim=1)
    if not bool((counts == counts[0]).all()):
        raise ValueError(f"every sample needs the same masked count, got {counts.tolist()}")
    num_keep = mask.shape[1] - int(counts[0])
    # A stable sort of 0 (visible) before 1 (masked) keeps each group in ascending index order.
    order = torch.sort(mask.to(torch.uint8), dim=1, stable=True).indices
    return order[:, :num_keep], order[:, num_keep:]
