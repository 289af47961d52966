"""Text-overlay detection: contrasted MSER glyphs chained into horizontal text lines."""

from __future__ import annotations

import cv2
import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from sapiens2.curation.quality import to_grey


class TextOverlayScorer:
    """Classical scene-text detector in the spirit of Neumann and Matas (MSER + line grouping).

    A glyph candidate is a maximally stable extremal region of caption size (4 px up to 12 % of
    the image height; larger titles made more false lines from flags and patterns) that
    stands out from the ring of pixels around it by at least ``min_contrast`` grey levels and
    is drawn with a thin stroke (twice its largest inscribed radius at most ``max_stroke`` of
    its height; filled blobs such as buttons, eyes or texture cells fail this). Overlay text is
    several such glyphs of similar height on one baseline with small gaps. ``text_score`` is the
    fraction of the image covered by the boxes of lines of at least ``min_chars`` glyphs.
    """

    def __init__(self, analysis_short_side: int = 256, delta: int = 6, min_contrast: float = 50.0,
                 max_stroke: float = 0.4, min_chars: int = 3) -> None:
        self.analysis_short_side = analysis_short_side
        self.delta = delta
        self.min_contrast = min_contrast
        self.max_stroke = max_stroke
        self.min_chars = min_chars

    def _is_glyph(self, grey: np.ndarray, pts: np.ndarray, box: np.ndarray) -> bool:
        x, y, w, h = (int(v) for v in box)
        height, width = grey.shape
        if not (4 <= h <= 0.12 * height and 0.1 <= w / h <= 2.0):
            return False
        x0, y0, x1, y1 = max(0, x - 2), max(0, y - 2), min(width, x + w + 2), min(height, y + h + 2)
        region = np.zeros((y1 - y0, x1 - x0), dtype=np.uint8)
        region[pts[:, 1] - y0, pts[:, 0] - x0] = 1
        ring = cv2.dilate(region, np.ones((3, 3), np.uint8)) - region
        patch = grey[y0:y1, x0:x1].astype(np.float32)
        if abs(patch[region > 0].mean() - patch[ring > 0].mean()) < self.min_contrast:
            return False
        inscribed = cv2.distanceTransform(np.pad(region, 1), cv2.DIST_L2, 3).max()
        return 2 * inscribed <= self.max_stroke * h

    def glyphs(self, grey: np.ndarray) -> np.ndarray:
        """Glyph boxes (N, 4) as x, y, w, h, one per glyph."""
        height, width = grey.shape
        mser = cv2.MSER_create(delta=self.delta, min_area=4, max_area=max(40, int(0.01 * height * width)))
        regions, boxes = mser.detectRegions(grey)
        keep = [box for pts, box in zip(regions, boxes) if self._is_glyph(grey, pts, box)]
        if not keep:
            return np.zeros((0, 4), dtype=np.int64)
        # MSER returns nested, near-identical regions per glyph; keep one box per glyph.
        return _suppress_nested(np.unique(np.asarray(keep, dtype=np.int64), axis=0))

    def __call__(self, image: np.ndarray) -> dict[str, float]:
        grey = to_grey(image, self.analysis_short_side)
        mask = np.zeros(grey.shape, dtype=bool)
        for x0, y0, x1, y1 in _chain_lines(self.glyphs(grey), self.min_chars):
            mask[y0:y1, x0:x1] = True
        return {"text_score": float(mask.mean())}


def _suppress_nested(boxes: np.ndarray) -> np.ndarray:
    """Drop boxes that mostly lie inside a larger kept box (inner contours of one glyph)."""
    order = np.argsort(-(boxes[:, 2] * boxes[:, 3]), kind="stable")
    kept: list[np.ndarray] = []
    for i in order:
        x, y, w, h = boxes[i]
        inside = any(
            max(0, min(x + w, kx + kw) - max(x, kx)) * max(0, min(y + h, ky + kh) - max(y, ky)) >= 0.7 * w * h
            for kx, ky, kw, kh in kept
        )
        if not inside:
            kept.append(boxes[i])
    return np.asarray(kept, dtype=np.int64).reshape(-1, 4)


# Glyphs of one line: heights within 1.5x, centres within a quarter height, and at most a
# 30 % overlap up to a 1.2-height gap between neighbours (letter and word spacing).
_HEIGHT_RATIO, _CENTRE_SHIFT, _GAP = 1.5, 0.25, 1.2


def _chain_lines(glyphs: np.ndarray, min_chars: int) -> list[tuple[int, int, int, int]]:
    """Union glyphs that could be neighbours on one line; return the x0, y0, x1, y1 boxes of
    the groups with at least ``min_chars`` glyphs."""
    x, y, w, h = (glyphs[:, k].astype(np.float64)[:, None] for k in range(4))
    cy = y + h / 2
    hmax, hmin = np.maximum(h, h.T), np.minimum(h, h.T)
    gap = np.maximum(x, x.T) - np.minimum(x + w, (x + w).T)
    aligned = (hmax <= _HEIGHT_RATIO * hmin) & (np.abs(cy - cy.T) <= _CENTRE_SHIFT * hmax)
    neighbours = aligned & (gap >= -0.3 * hmin) & (gap <= _GAP * hmax)
    _, labels = connected_components(csr_matrix(neighbours), directed=False)
    groups: dict[int, list[int]] = {}
    for i, label in enumerate(labels.tolist()):
        groups.setdefault(label, []).append(i)
    lines = []
    for members in groups.values():
        if len(members) >= min_chars:
            box = glyphs[members]
            lines.append((int(box[:, 0].min()), int(box[:, 1].min()),
                          int((box[:, 0] + box[:, 2]).max()), int((box[:, 1] + box[:, 3]).max())))
    return lines
