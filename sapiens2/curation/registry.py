"""The curation stage registry: the `Stage` interface and name -> stage class.

A stage scores a batch of decoded images into named columns and judges one image's scores into
a verdict (None to keep, or a detail string saying why it goes). Scoring and judging are apart
so the manifest keeps the evidence behind every verdict, and so a stage can batch its model
calls (an ONNX or TFLite scorer runs one forward pass per batch) while judging stays per row.

This module is a leaf: every stage module imports it to `@register`, and it imports none of
them. The modules that hold the platform's stages are listed in `STAGE_MODULES` and imported on
the registry's first lookup (mmengine's registry `locations`), so a lookup always sees them all.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    from sapiens2.curation.config import CurationConfig
    from sapiens2.curation.scorer import Scorer

# The modules whose stages register when imported, the built-in ones first.
STAGE_MODULES = (
    "sapiens2.curation.stages", "sapiens2.curation.clip_stages", "sapiens2.curation.detector",
    "sapiens2.curation.head_pose", "sapiens2.curation.ocr", "sapiens2.curation.safety",
)


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


class StageRegistry(Mapping[str, Callable[["CurationConfig"], Stage]]):
    """Stage name -> the class built from a `CurationConfig`; complete on every lookup."""

    def __init__(self, modules: Sequence[str]) -> None:
        self._modules, self._stages, self._loaded = tuple(modules), {}, False

    def _load(self) -> dict[str, Callable[[CurationConfig], Stage]]:
        if not self._loaded:
            self._loaded = True  # first, so a stage module importing the registry does not recurse
            try:
                for module in self._modules:
                    importlib.import_module(module)
            except BaseException:
                self._loaded = False  # retried on the next lookup: never a silently partial registry
                raise
        return self._stages

    def __getitem__(self, name: str) -> Callable[[CurationConfig], Stage]:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def __delitem__(self, name: str) -> None:  # a plugin (or a test) taking its stage back
        del self._stages[name]

    def add(self, cls: type[Stage]) -> None:
        if cls.name in self._stages:
            raise ValueError(f"stage {cls.name!r} is registered twice")
        self._stages[cls.name] = cls


STAGES = StageRegistry(STAGE_MODULES)


def register(cls: type[Stage]) -> type[Stage]:
    """Make ``cls`` selectable by its ``name`` in ``CurationConfig.stages``; built from the config."""
    STAGES.add(cls)
    return cls
