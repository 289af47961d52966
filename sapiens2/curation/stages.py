"""The built-in curation stages (size, phash, quality, text overlay, person) and `build_stages`.

``CurationConfig.stages`` names the stages in the order they run; an image stops at the first
stage that rejects it, so cheap stages go first. New stages register with ``@register``
(`sapiens2.curation.registry`); the model-backed ones live in their own modules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sapiens2.curation.config import CurationConfig
from sapiens2.curation.dedup import PhashScorer
from sapiens2.curation.person import PersonDetector
from sapiens2.curation.quality import QualityScorer
from sapiens2.curation.registry import STAGES, ScorerStage, Stage, register
from sapiens2.curation.size import SizeScorer
from sapiens2.curation.text import TextOverlayScorer

__all__ = ["STAGES", "Stage", "build_stages", "register"]


def build_stages(config: CurationConfig) -> list[Stage]:
    unknown = [name for name in config.stages if name not in STAGES]
    if unknown:
        raise ValueError(f"CurationConfig.stages: unknown stage(s) {unknown}; registered: {sorted(STAGES)}")
    return [STAGES[name](config) for name in config.stages]


@register
class SizeStage(ScorerStage):
    name, reason, columns = "size", "too_small", ("width", "height", "short_side")
    input_side = 1  # the header's size, not the pixels

    def __init__(self, config: CurationConfig) -> None:
        super().__init__(SizeScorer())
        self.min_short_side = config.min_short_side

    def score_decoded(self, images: Sequence[np.ndarray], sizes: Sequence[tuple[int, int]]) -> dict[str, list[Any]]:
        return {"width": [float(w) for w, _ in sizes], "height": [float(h) for _, h in sizes],
                "short_side": [float(min(size)) for size in sizes]}

    def judge(self, scores: Mapping[str, Any]) -> str | None:
        if scores["short_side"] < self.min_short_side:
            return f"short side {scores['short_side']:.0f} < {self.min_short_side}"
        return None


@register
class PhashStage(ScorerStage):
    """Score-only: the perceptual hash dedup needs; cheap, so it runs early for every usable image."""

    name, reason, columns = "phash", None, ("phash",)

    def __init__(self, config: CurationConfig) -> None:
        super().__init__(PhashScorer(config.phash_size))
        self.input_side = 4 * config.phash_size  # imagehash.phash works on a (4 * size)^2 thumbnail


@register
class QualityStage(ScorerStage):
    name, reason, columns = "quality", "low_quality", ("sharpness", "brightness", "clipped_fraction")

    def __init__(self, config: CurationConfig) -> None:
        super().__init__(QualityScorer())
        self.config = config
        self.input_side = self.scorer.analysis_short_side

    def judge(self, s: Mapping[str, Any]) -> str | None:
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


@register
class TextOverlayStage(ScorerStage):
    name, reason, columns = "text_overlay", "text_overlay", ("text_score",)

    def __init__(self, config: CurationConfig) -> None:
        super().__init__(TextOverlayScorer())
        self.max_text_score = config.max_text_score
        self.input_side = self.scorer.analysis_short_side

    def judge(self, scores: Mapping[str, Any]) -> str | None:
        if scores["text_score"] > self.max_text_score:
            return f"text score {scores['text_score']:.3f} > {self.max_text_score}"
        return None


@register
class PersonStage(ScorerStage):
    """At least one prominent person: a body box covering ``person.min_area_fraction`` of the
    image, or a face of ``person.min_face_fraction`` of the short side (see ``PersonDetector``)."""

    name, reason, columns = "person", "no_person", ("person_score", "num_persons", "person_area")

    def __init__(self, config: CurationConfig) -> None:
        super().__init__(PersonDetector(config.person))
        # Scans run on a copy resized to target_height; the short side needs no more than that.
        self.input_side = config.person.target_height

    def judge(self, scores: Mapping[str, Any]) -> str | None:
        if scores["num_persons"] < 1:
            return f"no prominent person (best HOG margin {scores['person_score']:.2f})"
        return None
