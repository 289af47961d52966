"""UDP heatmap codec for keypoints: Gaussian targets, argmax + DARK decoding, flip helpers.

Coordinates follow the data contract: image x = column + 0.5 (pixel centres at half-integers).
UDP (unbiased data processing) maps the first and last pixel centres of the image onto the
first and last heatmap cells, i.e. heatmap = (image - 0.5) * (hm_size - 1) / (image_size - 1).
That mapping is exactly mirror-symmetric, so flipped heatmaps need no shift in the flip test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np
import torch


def dark_blur_kernel_size(sigma: float) -> int:
    """Odd kernel size matching sigma via OpenCV's rule sigma = 0.3 * ((k - 1) / 2 - 1) + 0.8.

    Gives 11 for sigma 2, the size MMPose uses with that sigma.
    """
    k = int(round(2 * ((sigma - 0.8) / 0.3 + 1) + 1))
    return max(3, k | 1)


@dataclass(frozen=True)
class UDPHeatmapCodec:
    """Encode keypoints to Gaussian heatmaps and decode heatmaps back to image coordinates.

    Sizes are (height, width). sigma is in heatmap cells (2 at 64x48, 6 at 256x192).
    """

    input_size: tuple[int, int]
    heatmap_size: tuple[int, int]
    sigma: float

    def _scale(self) -> tuple[float, float]:
        (ih, iw), (hh, hw) = self.input_size, self.heatmap_size
        return (hw - 1) / (iw - 1), (hh - 1) / (ih - 1)

    def encode(self, keypoints: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, K, 3) keypoints (x, y, visibility) -> heatmaps (B, K, h, w) and weights (B, K).

        A keypoint gets weight 1 when it is labelled (visibility > 0) and its Gaussian reaches
        the heatmap (centre within 3 sigma of it), as in MMPose's UDP targets.
        """
        sx, sy = self._scale()
        h, w = self.heatmap_size
        mx = (keypoints[..., 0] - 0.5) * sx
        my = (keypoints[..., 1] - 0.5) * sy
        xs = torch.arange(w, dtype=keypoints.dtype, device=keypoints.device)
        ys = torch.arange(h, dtype=keypoints.dtype, device=keypoints.device)
        gx = torch.exp(-((xs - mx[..., None]) ** 2) / (2 * self.sigma**2))
        gy = torch.exp(-((ys - my[..., None]) ** 2) / (2 * self.sigma**2))
        radius = 3 * self.sigma
        reaches = (mx > -radius) & (mx < w - 1 + radius) & (my > -radius) & (my < h - 1 + radius)
        weights = ((keypoints[..., 2] > 0) & reaches).to(keypoints.dtype)
        heatmaps = gy[..., :, None] * gx[..., None, :] * weights[..., None, None]
        return heatmaps, weights

    def decode(self, heatmaps: np.ndarray) -> np.ndarray:
        """(B, K, h, w) heatmaps -> (B, K, 3): x, y in image pixels and the peak value as score."""
        heatmaps = np.asarray(heatmaps, dtype=np.float32)
        b, k, h, w = heatmaps.shape
        flat = heatmaps.reshape(b, k, -1)
        index = flat.argmax(axis=-1)
        scores = np.take_along_axis(flat, index[..., None], axis=-1)[..., 0]
        coords = np.stack([index % w, index // w], axis=-1).astype(np.float64)
        coords += self._dark_offsets(heatmaps.reshape(b * k, h, w), coords.reshape(-1, 2)).reshape(
            b, k, 2
        )
        sx, sy = self._scale()
        x = coords[..., 0] / sx + 0.5
        y = coords[..., 1] / sy + 0.5
        return np.stack([x, y, scores], axis=-1).astype(np.float32)

    def _dark_offsets(self, maps: np.ndarray, peaks: np.ndarray) -> np.ndarray:
        """DARK: one Newton step on the log of the smoothed heatmap around the argmax cell.

        Smoothing (a Gaussian of the target's sigma) suppresses noise in predicted maps, but its
        zero padding would pull peaks within a kernel radius of the border inwards, so those
        peaks take the step on the unsmoothed map, which is exact for a Gaussian there.
        """
        ksize = dark_blur_kernel_size(self.sigma)
        blurred = np.empty_like(maps)
        for i, m in enumerate(maps):
            b = cv2.GaussianBlur(m, (ksize, ksize), 0, borderType=cv2.BORDER_CONSTANT)
            # Keep the original peak height so the log clip below acts on the same range.
            blurred[i] = b * (m.max() / b.max()) if b.max() > 0 else b
        x, y = peaks[:, 0].astype(int), peaks[:, 1].astype(int)
        h, w = maps.shape[1:]
        r = ksize // 2
        window_inside = (x > r) & (x < w - 1 - r) & (y > r) & (y < h - 1 - r)
        smoothed = _newton_offsets(np.log(np.clip(blurred, 1e-3, 50.0)), x, y)
        raw = _newton_offsets(np.log(np.clip(maps, 1e-3, 50.0)), x, y)
        return np.where(window_inside[:, None], smoothed, raw)


def _newton_offsets(logs: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Sub-cell offset of the maximum of a quadratic fitted to the log map around cells (x, y).

    The 3x3 stencil is centred on the argmax cell, or moved one cell inwards when the argmax is
    on the border (a log-Gaussian is exactly quadratic, so a one-sided fit is still exact). The
    step -H^-1 g is taken only where the Hessian is negative definite (a real maximum), and the
    result is clipped to half a cell because the argmax cell already contains the maximum.
    Elsewhere the offset is 0 and the argmax stands.
    """
    n = np.arange(len(logs))
    h, w = logs.shape[1:]
    xi, yi = np.clip(x, 1, w - 2), np.clip(y, 1, h - 2)

    def at(dx: int, dy: int) -> np.ndarray:
        return logs[n, yi + dy, xi + dx].astype(np.float64)

    c = at(0, 0)
    gx = 0.5 * (at(1, 0) - at(-1, 0))
    gy = 0.5 * (at(0, 1) - at(0, -1))
    hxx = at(1, 0) - 2 * c + at(-1, 0)
    hyy = at(0, 1) - 2 * c + at(0, -1)
    hxy = 0.25 * (at(1, 1) - at(1, -1) - at(-1, 1) + at(-1, -1))
    det = hxx * hyy - hxy**2
    is_max = (hxx < 0) & (det > 1e-12)
    safe_det = np.where(is_max, det, 1.0)
    ox = xi - x - (hyy * gx - hxy * gy) / safe_det
    oy = yi - y - (-hxy * gx + hxx * gy) / safe_det
    return np.clip(np.stack([ox, oy], axis=-1), -0.5, 0.5) * is_max[:, None]


def flip_index(num_keypoints: int, flip_pairs: Sequence[tuple[int, int]]) -> list[int]:
    """Permutation mapping each keypoint to its mirror partner (itself when unpaired)."""
    index = list(range(num_keypoints))
    for left, right in flip_pairs:
        index[left], index[right] = right, left
    return index


def flip_heatmaps(heatmaps: torch.Tensor, index: Sequence[int]) -> torch.Tensor:
    """Heatmaps predicted on a mirrored image, mapped back to the original image's frame."""
    return heatmaps.flip(-1)[:, list(index)]
