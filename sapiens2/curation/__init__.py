"""Image-pool curation: decode, size, quality, text-overlay and person filters, then dedup.

Each scorer maps one decoded RGB uint8 image to a dict of named scores; ``FilterChain``
applies them cheapest first against a ``CurationConfig``. ``pipelines.curate`` runs the chain
over a folder, deduplicates the survivors and writes the manifest.
"""

from sapiens2.curation.config import CurationConfig, PersonDetectorConfig
from sapiens2.curation.decode import Decoded, decode_image
from sapiens2.curation.dedup import (BKTree, DuplicateGroups, PhashScorer, candidate_pairs, group_duplicates,
                                     orb_keypoints, similarity_inliers)
from sapiens2.curation.filters import REASONS, SCORE_COLUMNS, FilterChain
from sapiens2.curation.person import PersonDetector
from sapiens2.curation.quality import QualityScorer
from sapiens2.curation.scorer import Scorer, score_batch
from sapiens2.curation.size import SizeScorer
from sapiens2.curation.text import TextOverlayScorer

__all__ = [
    "BKTree", "CurationConfig", "Decoded", "DuplicateGroups", "FilterChain", "PersonDetector",
    "PersonDetectorConfig", "PhashScorer", "QualityScorer", "REASONS", "SCORE_COLUMNS", "Scorer",
    "SizeScorer", "TextOverlayScorer", "candidate_pairs", "decode_image", "group_duplicates",
    "orb_keypoints", "score_batch", "similarity_inliers",
]
