"""Typed, frozen configuration of the curation filters.

Defaults are tuned for the 128x96 demo pool; the reference Humans-1B recipe keeps images whose
short side is at least 384 px (SAPIENS2_FACTS section 5), set ``min_short_side=384`` there.
"""

from __future__ import annotations

from pathlib import Path

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


class CurationConfig(_Frozen):
    """All curation thresholds; one instance fully determines a curation run.

    Filters run cheapest first and an image stops at the first one it fails:
    decode -> size -> quality (exposure, blur) -> text overlay -> person -> dedup over survivors.
    """

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
    val_fraction: float = Field(0.15, ge=0.0, le=1.0)
    workers: int = Field(2, ge=1)

    @field_validator("brightness_range")
    @classmethod
    def _check_brightness(cls, value: tuple[float, float]) -> tuple[float, float]:
        lo, hi = value
        if not 0.0 <= lo < hi <= 255.0:
            raise ValueError(f"must satisfy 0 <= low < high <= 255, got {value}")
        return value

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
