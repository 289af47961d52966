"""Pluggable curation stages and their registry.

A stage scores a batch of decoded images into named columns and judges one image's scores into
a verdict (None to keep, or a detail string saying why it goes). Scoring and judging are apart
so the manifest keeps the evidence behind every verdict, and so a stage can batch its model
calls (an ONNX or TFLite scorer runs one forward pass per batch) while judging stays per row.

``CurationConfig.stages`` names the stages in the order they run; an image stops at the first
stage that rejects it, so cheap stages go first. New stages register with ``@register``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from sapiens2.curation.config import CurationConfig
from sapiens2.curation.dedup import PhashScorer
from sapiens2.curation.person import PersonDetector
from sapiens2.curation.quality import QualityScorer
from sapiens2.curation.scorer import Scorer
from sapiens2.curation.size import SizeScorer
from sapiens2.curation.text import TextOverlayScorer


class Stage(ABC):
    """One curation step: ``score`` a batch, ``judge`` one row of scores.

    ``reason`` is the manifest reason a rejection records (None for a score-only stage) and
    ``columns`` the score columns it fills, all of them for every image it scores.
    """

    name: ClassVar[str]
    reason: ClassVar[str | None]
    columns: ClassVar[tuple[str, ...]]
    # The short side (px) this stage's scores need at most; None = full resolution. When every
    # stage (and the embedder) names one, JPEGs are decoded in Pillow's reduced draft mode.
    input_side: int | None = None

    @abstractmethod
    def score(self, images: Sequence[np.ndarray]) -> dict[str, list[Any]]:
        """Column name -> one value per image, in input order."""

    def score_decoded(self, images: Sequence[np.ndarray], sizes: Sequence[tuple[int, int]]) -> dict[str, list[Any]]:
        """What the chain calls: ``sizes`` are the files' upright (width, height), which a draft
        decode may have shrunk the arrays below; only stages about the file's size need them."""
        return self.score(images)

    def judge(self, scores: Mapping[str, Any]) -> str | None:
        """None keeps the image; a string rejects it and says why (the manifest's ``detail``)."""
        return None


class ScorerStage(Stage):
    """A stage over a per-image ``Scorer``: score each image of the batch, gather columns."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

    def score(self, images: Sequence[np.ndarray]) -> dict[str, list[Any]]:
        rows = [self.scorer(image) for image in images]
        return {col: [row[col] for row in rows] for col in self.columns}


STAGES: dict[str, Callable[[CurationConfig], Stage]] = {}


def register(cls: type[Stage]) -> type[Stage]:
    """Make ``cls`` selectable by its ``name`` in ``CurationConfig.stages``; built from the config."""
    if cls.name in STAGES:
        raise ValueError(f"stage {cls.name!r} is registered twice")
    STAGES[cls.name] = cls
    return cls


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


# Model-backed stages live in their own modules (heavy imports happen when a stage is built).
from sapiens2.curation import clip, detector  # noqa: E402,F401  register their stages
from sapiens2.curation import head_pose, ocr, safety  # noqa: E402,F401  register their stages
