"""The per-image filter chain: cheapest checks first, stopping at the first failure.

Every image gets one row; the scores computed before it stopped are kept as evidence, the
rest stay empty (None), so a manifest reader can tell "not measured" from "measured low".
Deduplication needs all survivors at once and runs afterwards (see ``pipelines.curate``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sapiens2.curation.config import CurationConfig
from sapiens2.curation.decode import decode_image
from sapiens2.curation.dedup import PhashScorer
from sapiens2.curation.person import PersonDetector
from sapiens2.curation.quality import QualityScorer
from sapiens2.curation.size import SizeScorer
from sapiens2.curation.text import TextOverlayScorer

REASONS = ("unreadable", "too_small", "low_quality", "text_overlay", "no_person", "duplicate")
SCORE_COLUMNS = ("width", "height", "short_side", "sharpness", "brightness", "clipped_fraction",
                 "text_score", "person_score", "num_persons", "person_area", "phash")


class FilterChain:
    """Decode, score and judge one file against a ``CurationConfig``.

    Holds OpenCV detectors, so it is not picklable: build one per worker process.
    """

    def __init__(self, config: CurationConfig) -> None:
        self.config = config
        self.size = SizeScorer()
        self.quality = QualityScorer()
        self.text = TextOverlayScorer()
        self.person = PersonDetector(config.person)
        self.phash = PhashScorer(config.phash_size)

    def _quality_problem(self, s: dict[str, Any]) -> str | None:
        # Exposure first: a black or blown-out frame is flat too, but "exposure" says why.
        cfg = self.config
        lo, hi = cfg.brightness_range
        if not lo <= s["brightness"] <= hi:
            return f"exposure: brightness {s['brightness']:.1f} outside [{lo}, {hi}]"
        if s["clipped_fraction"] > cfg.max_clipped_fraction:
            return f"exposure: clipped fraction {s['clipped_fraction']:.3f} > {cfg.max_clipped_fraction}"
        if s["sharpness"] < cfg.min_sharpness:
            return f"blurred: sharpness {s['sharpness']:.1f} < {cfg.min_sharpness}"
        return None

    def assess(self, path: str | Path) -> dict[str, Any]:
        """One manifest row (without id, paths, dedup and split columns) for the file at ``path``."""
        cfg = self.config
        row: dict[str, Any] = dict.fromkeys(SCORE_COLUMNS) | {"status": "kept", "reason": None, "detail": None}

        def reject(reason: str, detail: str, status: str = "rejected") -> dict[str, Any]:
            return row | {"status": status, "reason": reason, "detail": detail}

        decoded = decode_image(path, cfg.max_pixels)
        if not decoded.ok:
            return reject("unreadable", decoded.error, status="quarantined")
        image = decoded.image
        row.update(self.size(image))
        if row["short_side"] < cfg.min_short_side:
            return reject("too_small", f"short side {row['short_side']:.0f} < {cfg.min_short_side}")
        row.update(self.phash(image))
        row.update(self.quality(image))
        problem = self._quality_problem(row)
        if problem is not None:
            return reject("low_quality", problem)
        row.update(self.text(image))
        if row["text_score"] > cfg.max_text_score:
            return reject("text_overlay", f"text score {row['text_score']:.3f} > {cfg.max_text_score}")
        row.update(self.person(image))
        if row["num_persons"] < 1:
            return reject("no_person", f"no prominent person (best HOG margin {row['person_score']:.2f})")
        return row
