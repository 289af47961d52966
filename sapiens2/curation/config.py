"""Typed, frozen configuration of the curation filters.

Defaults are tuned for the 128x96 demo pool; the reference Humans-1B recipe keeps images whose
short side is at least 384 px (SAPIENS2_FACTS section 5), set ``min_short_side=384`` there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PersonDetectorConfig(_Frozen):
    """Settings of the HOG body detector (OpenCV's 64x128 Dalal-Triggs model) and the cascades.

    Images are resized so their height is ``target_height`` before scanning and padded by
    ``pad_fraction`` of that height on each side. The 64x128 window holds a 96 px tall body, so
    the smallest findable body is 96 / ``target_height`` of the image height: 160 (60 %) suits
    the 128x96 demo, where people fill most of the frame; use ~480 for web photos (20 %).
    """

    target_height: int = Field(160, ge=64)
    pad_fraction: float = Field(0.25, ge=0.0, le=1.0)
    win_stride: int = Field(8, ge=1)
    scale: float = Field(1.05, gt=1.0, le=2.0)
    # Scanning below the decision margin lets weak neighbouring windows join a body's cluster
    # (OpenCV groups windows before scoring); on the synthetic pool it recovers ~3 % of people.
    hit_threshold: float = Field(-0.25, description="HOG window margin kept for grouping")
    min_score: float = Field(0.0, description="HOG SVM margin a grouped body detection needs to count")
    min_area_fraction: float = Field(0.05, ge=0.0, le=1.0, description="prominence: body box area / image area")
    use_body_cascade: bool = True
    body_min_neighbors: int = Field(2, ge=1)
    use_face_cascade: bool = True
    min_face_fraction: float = Field(0.12, gt=0.0, le=1.0, description="prominence: face side / image short side")
    face_min_neighbors: int = Field(5, ge=1)

    @model_validator(mode="after")
    def _check_scan(self) -> PersonDetectorConfig:
        if self.hit_threshold > self.min_score:
            raise ValueError(f"hit_threshold {self.hit_threshold} must not exceed min_score {self.min_score}")
        return self


class EmbeddingConfig(_Frozen):
    """The image embedding behind deep-feature dedup and cluster balancing.

    ``tiny_image`` (default) is the zero-mean, unit-norm ``tiny_side``-px RGB thumbnail
    (Torralba's tiny images): deterministic, offline, microseconds per image, and its cosine
    similarity is high for re-encodes, resizes, small crops and colour shifts of one photo.
    ``backbone`` is the CLS feature of a Sapiens2 backbone (``sapiens2.model.build_backbone``)
    from ``backbone_weights``; without weights it is a fixed random-init network (seed 0), which
    is deterministic but only a weak descriptor, so give trained weights for semantic clusters.
    """

    embedder: Literal["tiny_image", "backbone"] = "tiny_image"
    # On the synthetic pool (seed 7) 8 px separates best: copies and crops of one photo sit at
    # cosine >= 0.958, distinct photos <= 0.893 (at 16 px: >= 0.848 against <= 0.803).
    tiny_side: int = Field(8, ge=4, le=64)
    backbone_arch: str = "sapiens2_debug"
    backbone_weights: Path | None = None
    backbone_input: int = Field(128, ge=32, description="square input side in pixels; a multiple of the patch")
    near_dup_cosine: float | None = Field(None, gt=0.0, le=1.0,
                                          description="prune pairs at least this similar (0.93 suits tiny_image);"
                                                      " None skips the step")


class BalanceConfig(_Frozen):
    """Hierarchical k-means balancing (Vo et al. 2024): ``clusters`` leaf clusters of the
    embeddings, ``top_clusters`` clusters of their centroids; the target size is split evenly
    across top clusters, then across their leaves, capped by what each holds."""

    target_size: int | None = Field(None, ge=1, description="kept images after balancing; None keeps all")
    clusters: int = Field(16, ge=1)
    top_clusters: int = Field(4, ge=1)
    niter: int = Field(25, ge=1)
    restarts: int = Field(5, ge=1, description="k-means runs per level; the lowest-error one is kept")
    seed: int = 0

    @model_validator(mode="after")
    def _check_levels(self) -> BalanceConfig:
        if self.top_clusters > self.clusters:
            raise ValueError(f"top_clusters {self.top_clusters} exceeds clusters {self.clusters}")
        return self


class CurationConfig(_Frozen):
    """All curation thresholds; one instance fully determines a curation run.

    Filters run in ``stages`` order (cheapest first) and an image stops at the first one it
    fails: decode -> size -> quality (exposure, blur) -> text overlay -> person by default, then
    dedup over the survivors (exact hash, perceptual hash, optional embedding cosine) and the
    optional cluster-balanced sampling.
    """

    stages: tuple[str, ...] = Field(("size", "phash", "quality", "text_overlay", "person"),
                                    description="registered stage names in run order (sapiens2.curation.stages)")

    min_short_side: int = Field(64, ge=1, description="384 at reference scale")
    max_pixels: int = Field(64_000_000, ge=1, description="decompression-bomb guard")
    min_sharpness: float = Field(20.0, ge=0.0, description="variance of the Laplacian on grey")
    brightness_range: tuple[float, float] = (20.0, 235.0)
    max_clipped_fraction: float = Field(0.25, ge=0.0, le=1.0, description="share of pixels <= 5 or >= 250")
    max_text_score: float = Field(0.08, ge=0.0, le=1.0, description="image share covered by text lines")
    person: PersonDetectorConfig = PersonDetectorConfig()
    phash_size: int = Field(8, ge=4, description="DCT hash side; the hash has phash_size**2 bits")
    phash_hamming: int = Field(16, ge=0, description="pairs within this many bits become candidates")
    dup_verify: bool = Field(True, description="confirm candidates geometrically; False trusts the hash")
    dup_min_inliers: int = Field(50, ge=4, description="ORB matches a crop/resize transform must explain")
    embedding: EmbeddingConfig = EmbeddingConfig()
    balance: BalanceConfig = BalanceConfig()
    val_fraction: float = Field(0.15, ge=0.0, le=1.0)
    workers: int = Field(2, ge=1)
    batch_size: int = Field(8, ge=1, description="images each stage scores per call in a worker")

    @field_validator("brightness_range")
    @classmethod
    def _check_brightness(cls, value: tuple[float, float]) -> tuple[float, float]:
        lo, hi = value
        if not 0.0 <= lo < hi <= 255.0:
            raise ValueError(f"must satisfy 0 <= low < high <= 255, got {value}")
        return value

    @field_validator("stages")
    @classmethod
    def _check_stages(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from sapiens2.curation.stages import STAGES  # the registry imports this module

        unknown = [name for name in value if name not in STAGES]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; registered: {sorted(STAGES)}")
        if len(set(value)) != len(value):
            raise ValueError(f"stages repeat: {list(value)}")
        if "phash" not in value:
            raise ValueError("'phash' must be among the stages: perceptual dedup needs it")
        return value

    @property
    def needs_embeddings(self) -> bool:
        return self.embedding.near_dup_cosine is not None or self.balance.target_size is not None

    @model_validator(mode="after")
    def _check_hash_bits(self) -> CurationConfig:
        if self.phash_hamming > self.phash_size**2:
            raise ValueError(f"phash_hamming {self.phash_hamming} exceeds the {self.phash_size**2}-bit hash")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> CurationConfig:
        """Load a config; errors name the file and the offending field."""
        path = Path(path)
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of CurationConfig fields, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            fields = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in err.errors()
            )
            raise ValueError(f"{path}: invalid curation config: {fields}") from err
