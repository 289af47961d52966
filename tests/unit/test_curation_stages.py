"""Stage registry, bad-input handling, exact/embedding dedup, cluster balance and the report."""

from __future__ import annotations

import io
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest
from matplotlib import cbook
from PIL import Image
from skimage import data as skimage_data

from pipelines.curate import curate
from sapiens2.curation import CurationConfig, FilterChain, decode_image
from sapiens2.curation.balance import Clusters, balanced_sample, hierarchical_clusters, water_fill
from sapiens2.curation.config import BalanceConfig, EmbeddingConfig
from sapiens2.curation.embed import TinyImageEmbedder, near_duplicate_pairs
from sapiens2.curation.stages import STAGES, Stage, build_stages, register

# Detector-free stages keep these tests fast and independent of the HOG/Haar recall.
CHEAP = CurationConfig(workers=1, stages=("size", "phash", "quality"))


@pytest.fixture(scope="module")
def hopper() -> np.ndarray:
    """A real photo of a person (600x512) shipped with matplotlib, at 128 px wide."""
    image = np.asarray(Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)).convert("RGB"))
    return cv2.resize(image, (128, 150), interpolation=cv2.INTER_AREA)


def _encode(image: np.ndarray | Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _texture(seed: int, size: tuple[int, int] = (120, 100)) -> np.ndarray:
    """A sharp, mid-grey random texture: passes size and quality, unlike any other seed's."""
    rng = np.random.default_rng(seed)
    small = rng.integers(40, 215, size=(size[0] // 6, size[1] // 6, 3), dtype=np.uint8)
    return cv2.resize(small, (size[1], size[0]), interpolation=cv2.INTER_NEAREST)


# ---- registry -------------------------------------------------------------------------------


class _RedStage(Stage):
    """Rejects red-dominated images and records how it was called."""

    name, reason, columns = "test_red", "too_red", ("red_share",)
    batches: list[int] = []

    def __init__(self, config: CurationConfig) -> None:
        pass

    def score(self, images):
        type(self).batches.append(len(images))
        return {"red_share": [float(im[..., 0].mean() / (im.mean() * 3 + 1e-9)) for im in images]}

    def judge(self, scores):
        return f"red share {scores['red_share']:.2f}" if scores["red_share"] > 0.5 else None


@pytest.fixture
def red_stage():
    register(_RedStage)
    _RedStage.batches = []
    yield _RedStage
    del STAGES[_RedStage.name]


def test_a_registered_stage_scores_only_survivors_in_one_batch(tmp_path, red_stage):
    red = np.zeros((100, 100, 3), np.uint8)
    red[..., 0] = np.random.default_rng(0).integers(100, 255, (100, 100), dtype=np.uint8)
    files = {"red.png": red, "tiny.png": _texture(1, (40, 40)), "grey.png": _texture(2)}
    for name, image in files.items():
        Image.fromarray(image).save(tmp_path / name)
    chain = FilterChain(CurationConfig(stages=("size", "phash", "test_red")))
    rows = chain.assess_batch([tmp_path / name for name in files])
    assert red_stage.batches == [2]  # the too-small image never reached the costlier stage
    assert [(r["status"], r["reason"]) for r in rows] == [("rejected", "too_red"), ("rejected", "too_small"),
                                                          ("kept", None)]
    assert rows[1]["red_share"] is None and rows[2]["red_share"] < 0.5
    assert "red_share" in chain.columns


def test_stage_selection_skips_unlisted_stages(tmp_path):
    path = tmp_path / "texture.png"
    Image.fromarray(_texture(3)).save(path)
    assert FilterChain(CurationConfig()).assess(path)["reason"] == "no_person"
    row = FilterChain(CHEAP).assess(path)
    assert row["status"] == "kept" and row["num_persons"] is None and row["text_score"] is None


@pytest.mark.parametrize("stages, message", [(["size", "hog"], "unknown stage"), (["size"], "'phash' must be"),
                                             (["size", "phash", "size"], "repeat")])
def test_stage_list_errors_name_file_and_field(tmp_path, stages, message):
    path = tmp_path / "curation.yaml"
    path.write_text(f"stages: {stages}\n")
    with pytest.raises(ValueError, match=rf"curation.yaml.*stages.*{message}"):
        CurationConfig.from_yaml(path)


# ---- bad input ------------------------------------------------------------------------------


def _bad_pool(root: Path, hopper: np.ndarray) -> dict[str, str]:
    """Every awkward file kind; returns name -> expected status."""
    images = root / "images"
    images.mkdir(parents=True)
    (images / "truncated.jpg").write_bytes(_encode(hopper, "JPEG")[:700])
    (images / "empty.jpg").write_bytes(b"")
    (images / "text.jpg").write_text("<html>404 Not Found</html>\n")
    Image.new("L", (3000, 3000), 128).save(images / "bomb.png")  # 9 MP in a few kB
    (images / "cmyk.jpg").write_bytes(_encode(Image.fromarray(_texture(10)).convert("CMYK"), "JPEG", quality=95))
    grey16 = (cv2.cvtColor(_texture(11), cv2.COLOR_RGB2GRAY).astype(np.uint16) * 257)
    Image.fromarray(grey16).save(images / "grey16.png")
    palette = Image.fromarray(_texture(12)).convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    palette.save(images / "palette.png", transparency=0)
    frames = [Image.fromarray(_texture(13)), Image.fromarray(np.zeros((120, 100, 3), np.uint8))]
    frames[0].save(images / "animated.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways; viewers rotate 90 degrees clockwise
    (images / "rotated.jpg").write_bytes(_encode(np.ascontiguousarray(np.rot90(hopper)), "JPEG", exif=exif.tobytes()))
    return {"truncated": "quarantined", "empty": "quarantined", "text": "quarantined", "bomb": "quarantined",
            "cmyk": "kept", "grey16": "kept", "palette": "kept", "animated": "kept", "rotated": "kept"}


def test_bad_inputs_never_stop_a_run_and_nothing_is_lost(tmp_path, hopper):
    expected = _bad_pool(tmp_path / "pool", hopper)
    config = CHEAP.model_copy(update={"max_pixels": 4_000_000})
    summary = curate(tmp_path / "pool", tmp_path / "out", config)
    manifest = pd.read_parquet(summary.manifest_path).set_index("id")
    assert summary.n_inputs == len(expected) == sum(summary.status_counts.values())
    assert manifest["status"].to_dict() == expected
    quarantined = manifest[manifest["status"] == "quarantined"]
    assert (quarantined["reason"] == "unreadable").all()
    assert quarantined["detail"].str.startswith("unreadable: ").all()
    assert "max_pixels=4000000" in quarantined.loc["bomb", "detail"]
    # Upright before scoring: the portrait is scored as 128 wide and 150 high.
    assert (manifest.loc["rotated", "width"], manifest.loc["rotated", "height"]) == (128, 150)
    again = curate(tmp_path / "pool", tmp_path / "again", config)
    assert again.manifest_path.read_bytes() == summary.manifest_path.read_bytes()
    steps = ["decode", *config.stages, "dedup", "balance", "write", "report"]
    assert [s for s in steps if s not in summary.stage_seconds] == []
    assert "embed" not in summary.stage_seconds  # no embedding model in this config
    assert all(v >= 0 for v in summary.stage_seconds.values())
    assert sum(summary.stage_seconds.values()) <= summary.seconds


def test_decode_scales_16_bit_composites_alpha_and_takes_the_first_frame(tmp_path, hopper):
    _bad_pool(tmp_path, hopper)
    images = tmp_path / "images"
    grey = cv2.cvtColor(_texture(11), cv2.COLOR_RGB2GRAY)
    decoded16 = decode_image(images / "grey16.png", 10**8).image
    assert np.abs(decoded16[..., 0].astype(int) - grey).max() <= 1  # scaled, not clipped at 255
    transparent = Image.open(images / "palette.png").convert("RGBA")
    clear = np.asarray(transparent)[..., 3] == 0
    assert clear.any() and (decode_image(images / "palette.png", 10**8).image[clear] == 255).all()
    first = decode_image(images / "animated.gif", 10**8).image
    assert first.shape == (120, 100, 3) and first.mean() > 60  # frame 0, not the black frame 1
    cmyk = decode_image(images / "cmyk.jpg", 10**8).image.astype(int)
    assert np.abs(cmyk - _texture(10)).mean() < 12


# ---- dedup ----------------------------------------------------------------------------------


def test_exact_copies_group_by_content_hash_before_perceptual_hash(tmp_path):
    images = tmp_path / "pool" / "images"
    images.mkdir(parents=True)
    data = _encode(_texture(20), "PNG")
    for name in ("a.png", "b.png", "c.png"):
        (images / name).write_bytes(data)
    Image.fromarray(_texture(21)).save(images / "other.png")
    manifest = pd.read_parquet(curate(tmp_path / "pool", tmp_path / "out", CHEAP).manifest_path).set_index("id")
    assert manifest["status"].to_dict() == {"a": "kept", "b": "rejected", "c": "rejected", "other": "kept"}
    assert manifest.loc[["b", "c"], "detail"].tolist() == ["duplicate of a (identical sha256)"] * 2
    assert manifest.loc[["a", "b", "c"], "dup_group"].tolist() == ["a"] * 3
    assert pd.isna(manifest.loc["other", "dup_group"]) and manifest["sha256"].str.len().eq(64).all()


def test_tiny_image_cosine_separates_copies_from_other_images(hopper):
    brighter = np.clip(hopper.astype(int) + 25, 0, 255).astype(np.uint8)
    cropped = cv2.resize(hopper[6:-6, 6:-6], (128, 150))
    emb = TinyImageEmbedder(8)([hopper, brighter, cropped, _texture(30, (150, 128))])
    sim = emb @ emb.T
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert sim[0, 1] > 0.99 and sim[0, 2] > 0.93 and sim[0, 3] < 0.5


def test_faiss_pairs_match_brute_force():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 16)).astype(np.float32)
    x[30:40] = x[:10] + 0.1 * rng.normal(size=(10, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    sim = x @ x.T
    brute = {(i, j) for i in range(60) for j in range(i + 1, 60) if sim[i, j] >= 0.9}
    found = near_duplicate_pairs(x, 0.9)
    assert {(i, j) for i, j, _ in found} == brute and len(brute) >= 10
    assert near_duplicate_pairs(x[:1], 0.5) == []


def test_embedding_dedup_prunes_near_copies_in_curate(tmp_path, hopper):
    images = tmp_path / "pool" / "images"
    images.mkdir(parents=True)
    Image.fromarray(hopper).save(images / "photo.png")
    near = np.clip(cv2.resize(hopper[5:-5, 5:-5], (64, 75)).astype(int) + 20, 0, 255).astype(np.uint8)
    (images / "photo_small.jpg").write_bytes(_encode(near, "JPEG", quality=70))
    Image.fromarray(_texture(40, (150, 128))).save(images / "other.png")
    # A 256-bit hash at radius 0 leaves the near copy to the embedding pass.
    config = CHEAP.model_copy(update={"phash_size": 16, "phash_hamming": 0,
                                      "embedding": EmbeddingConfig(near_dup_cosine=0.93)})
    manifest = pd.read_parquet(curate(tmp_path / "pool", tmp_path / "out", config).manifest_path).set_index("id")
    assert manifest.loc["photo_small", "reason"] == "duplicate"
    assert "embedding cosine" in manifest.loc["photo_small", "detail"]
    assert manifest.loc["photo", "status"] == manifest.loc["other", "status"] == "kept"


# ---- balance --------------------------------------------------------------------------------


def test_water_fill_caps_small_groups_and_spreads_the_rest():
    assert water_fill([100, 20, 5], 30) == [13, 12, 5]
    assert water_fill([3, 3], 10) == [3, 3]
    assert water_fill([0, 7, 7], 5) == [0, 3, 2]
    assert sum(water_fill([9, 1, 4, 30], 17)) == 17


def _blobs(sizes: list[int], dim: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = np.eye(dim, dtype=np.float32)[: len(sizes)] * 5
    x = np.concatenate([c + rng.normal(scale=0.3, size=(n, dim)) for c, n in zip(centres, sizes)]).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True), np.repeat(np.arange(len(sizes)), sizes)


def test_hierarchical_kmeans_recovers_blobs_and_sampling_balances_them():
    x, truth = _blobs([100, 20, 5])
    config = BalanceConfig(clusters=9, top_clusters=3, seed=0)
    clusters = hierarchical_clusters(x, config)
    # The dense blob takes most leaves, but each top cluster is exactly one blob.
    assert len(set(clusters.leaf[truth == 0])) > 3
    assert sorted(len(set(clusters.top[truth == b])) for b in range(3)) == [1, 1, 1]
    assert len(set(clusters.top.tolist())) == 3
    ids = [f"img{i:03d}" for i in range(len(x))]
    keep = balanced_sample(ids, clusters, 30, seed=0)
    assert np.bincount(truth[keep], minlength=3).tolist() == [13, 12, 5]
    again = balanced_sample(ids, hierarchical_clusters(x, config), 30, seed=0)
    assert (keep == again).all()


def test_balanced_sample_splits_over_top_clusters_first():
    # Leaves 0-2 share top 0, leaf 3 is top 1 alone: top 1 gets half the target.
    clusters = Clusters(np.repeat(np.arange(4), [10, 10, 10, 10]), np.array([0, 0, 0, 1]))
    keep = balanced_sample([str(i) for i in range(40)], clusters, 12)
    assert np.bincount(clusters.leaf[keep], minlength=4).tolist() == [2, 2, 2, 6]


# ---- balance and report in a run ------------------------------------------------------------


def test_curate_balances_records_clusters_and_writes_the_report(tmp_path):
    images = tmp_path / "pool" / "images"
    images.mkdir(parents=True)
    for i in range(24):  # two looks: 18 of one colour family, 6 of another
        base = _texture(100 + i)
        tint = (np.array([1.0, 0.6, 0.6]) if i < 18 else np.array([0.6, 0.6, 1.0]))
        Image.fromarray((base * tint).astype(np.uint8)).save(images / f"img{i:02d}.png")
    (images / "broken.jpg").write_bytes(b"not a jpeg")
    config = CHEAP.model_copy(update={"min_sharpness": 0.0, "balance": BalanceConfig(
        target_size=10, clusters=4, top_clusters=2)})
    summary = curate(tmp_path / "pool", tmp_path / "out", config)
    manifest = pd.read_parquet(summary.manifest_path)
    kept = manifest[manifest["status"] == "kept"]
    assert len(kept) == 10 and summary.reason_counts["over_represented"] == 14
    assert kept["cluster"].notna().all() and manifest.loc[manifest["status"] == "quarantined", "cluster"].isna().all()
    assert sum(summary.cluster_sizes["before"]) == 24 and sum(summary.cluster_sizes["after"]) == 10
    report = summary.report_path.read_text()
    assert summary.report_path == tmp_path / "out" / "report.md"
    for heading in ("## Counts per stage", "## Reject reasons", "## Score histograms", "### over_represented (14)",
                    "### unreadable (1)", "## Cluster balance"):
        assert heading in report
    assert "| balance | over_represented |        24 |        14 |" in report
    for png in ("scores.png", "rejected_over_represented.png", "clusters.png"):
        assert (tmp_path / "out" / "report" / png).stat().st_size > 1000
    again = curate(tmp_path / "pool", tmp_path / "again", config)
    assert again.manifest_path.read_bytes() == summary.manifest_path.read_bytes()
    steps = ["decode", *config.stages, "embed", "dedup", "balance", "write", "report"]  # balance embeds
    assert [s for s in steps if s not in summary.stage_seconds] == []
    assert all(v >= 0 for v in summary.stage_seconds.values())
    assert sum(summary.stage_seconds.values()) <= summary.seconds


def test_backbone_embedder_is_deterministic_and_loads_weights(tmp_path, hopper):
    from sapiens2.curation.embed import BackboneEmbedder
    from sapiens2.model.checkpoint import save_checkpoint

    config = EmbeddingConfig(embedder="backbone", backbone_arch="sapiens2_debug", backbone_input=64)
    first = BackboneEmbedder(config)
    batch = [hopper, _texture(50, (90, 70))]
    a, b = first(batch), BackboneEmbedder(config)(batch)
    assert a.shape == (2, first.dim) and np.array_equal(a, b)
    weights = tmp_path / "backbone.safetensors"
    for param in first.model.parameters():
        param.data.mul_(-1.5)
    save_checkpoint(first.model, weights)
    loaded = BackboneEmbedder(config.model_copy(update={"backbone_weights": weights}))
    assert np.allclose(loaded(batch), first(batch), atol=1e-5) and not np.allclose(loaded(batch), a, atol=1e-3)


def _photo(name: str) -> np.ndarray:
    """A photograph shipped inside scikit-image (no download), as RGB uint8."""
    image = getattr(skimage_data, name)()
    return np.dstack([image] * 3) if image.ndim == 2 else image[..., :3]


@pytest.mark.parametrize("name,has_person", [("astronaut", True), ("coffee", False), ("rocket", False)])
def test_each_default_scorer_on_packaged_photographs(name, has_person):
    """Every default stage on real photos: none is too small, blurred, badly exposed or captioned;
    only the astronaut (a person) passes the person stage."""
    image = _photo(name)
    verdicts = {}
    for stage in build_stages(CurationConfig()):
        scores = stage.score([image])
        verdicts[stage.name] = stage.judge({column: values[0] for column, values in scores.items()})
    assert {k: v for k, v in verdicts.items() if k != "person"} == dict.fromkeys(
        ["size", "phash", "quality", "text_overlay"])
    assert (verdicts["person"] is None) == has_person, verdicts["person"]


@pytest.mark.xfail(strict=True, reason="known false positive: the person stage finds 2 'people' (score 0.70, "
                                       "42 % of the frame) in this cat photo; a learned detector is still to come")
def test_person_stage_rejects_a_cat():
    stage = next(s for s in build_stages(CurationConfig()) if s.name == "person")
    scores = stage.score([_photo("chelsea")])
    assert stage.judge({column: values[0] for column, values in scores.items()}) is not None
