"""Image-pool curation: decode, registered filter stages, dedup, cluster balance and a report.

Each stage scores a batch of decoded RGB uint8 images into named columns and judges each row
(``stages.Stage``); ``FilterChain`` runs the stages ``CurationConfig.stages`` names, cheapest
first. ``pipelines.curate`` runs the chain over a folder, deduplicates the survivors (content
hash, perceptual hash, optional embedding cosine), optionally balances them across k-means
clusters, and writes the manifest and ``report.md``.
"""

from sapiens2.curation.balance import Clusters, balanced_sample, hierarchical_clusters, water_fill
from sapiens2.curation.config import BalanceConfig, CurationConfig, EmbeddingConfig, PersonDetectorConfig
from sapiens2.data.decode import Decoded, decode_image
from sapiens2.curation.dedup import (BKTree, DuplicateGroups, PhashScorer, candidate_pairs, group_duplicates,
                                     orb_keypoints, similarity_inliers)
from sapiens2.curation.embed import BackboneEmbedder, TinyImageEmbedder, build_embedder, near_duplicate_pairs
from sapiens2.curation.filters import REASONS, SCORE_COLUMNS, FilterChain
from sapiens2.curation.person import PersonDetector
from sapiens2.curation.quality import QualityScorer
from sapiens2.curation.report import write_report
from sapiens2.curation.scorer import Scorer, score_batch
from sapiens2.curation.size import SizeScorer
from sapiens2.curation.stages import STAGES, Stage, build_stages, register
from sapiens2.curation.text import TextOverlayScorer

__all__ = [
    "BKTree", "BackboneEmbedder", "BalanceConfig", "Clusters", "CurationConfig", "Decoded", "DuplicateGroups",
    "EmbeddingConfig", "FilterChain", "PersonDetector", "PersonDetectorConfig", "PhashScorer", "QualityScorer",
    "REASONS", "SCORE_COLUMNS", "STAGES", "Scorer", "SizeScorer", "Stage", "TextOverlayScorer", "TinyImageEmbedder",
    "balanced_sample", "build_embedder", "build_stages", "candidate_pairs", "decode_image", "group_duplicates",
    "hierarchical_clusters", "near_duplicate_pairs", "orb_keypoints", "register", "score_batch",
    "similarity_inliers", "water_fill", "write_report",
]
