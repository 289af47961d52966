"""Curation scorers, dedup grouping, decode quarantine and config validation."""

from __future__ import annotations

import io
from pathlib import Path

import cv2
import numpy as np
import pytest
from matplotlib import cbook
from PIL import Image
from pydantic import ValidationError

from pipelines.curate import assign_split
from sapiens2.curation import (
    BKTree,
    CurationConfig,
    FilterChain,
    PersonDetector,
    PersonDetectorConfig,
    PhashScorer,
    QualityScorer,
    SizeScorer,
    TextOverlayScorer,
    candidate_pairs,
    decode_image,
    group_duplicates,
    orb_keypoints,
    score_batch,
    similarity_inliers,
)
from sapiens2.curation.dedup import hamming

CONFIG = CurationConfig()


@pytest.fixture(scope="module")
def hopper() -> np.ndarray:
    """A real photo of a person (head and shoulders, 600x512) shipped with matplotlib."""
    return np.asarray(Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)).convert("RGB"))


@pytest.fixture(scope="module")
def hopper_small(hopper) -> np.ndarray:
    return cv2.resize(hopper, (96, 128), interpolation=cv2.INTER_AREA)


def landscape(seed: int = 0, height: int = 128, width: int = 96) -> np.ndarray:
    """A person-free image: shaded terrain from matplotlib's elevation sample plus sky."""
    dem = np.load(cbook.get_sample_data("jacksboro_fault_dem.npz", asfileobj=False))["elevation"]
    grey = ((dem - dem.min()) / np.ptp(dem) * 200 + 30).astype(np.uint8)
    rgb = cv2.resize(np.dstack([grey, (grey * 0.8).astype(np.uint8), (grey * 0.5).astype(np.uint8)]), (width, height))
    rgb[: height // 3] = (120, 170, 230)
    return np.roll(rgb, seed, axis=1)


def caption(image: np.ndarray, lines: list[str]) -> np.ndarray:
    """White text with a black outline, one line per entry, like a meme or watermark overlay."""
    out = image.copy()
    height = out.shape[0]
    scale = 0.4 * height / 128
    for k, text in enumerate(lines):
        org = (2, int(height * (0.15 + 0.8 * k / max(1, len(lines) - 1))))
        cv2.putText(out, text, org, cv2.FONT_HERSHEY_SIMPLEX, scale, (0, 0, 0), 3, cv2.LINE_AA)
        cv2.putText(out, text, org, cv2.FONT_HERSHEY_SIMPLEX, scale, (255, 255, 255), 1, cv2.LINE_AA)
    return out


# ---- decode -------------------------------------------------------------------------------


def _jpeg(image: np.ndarray, quality: int = 92, **kwargs) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=quality, **kwargs)
    return buf.getvalue()


@pytest.mark.parametrize("content", [b"", "truncated", b"<html><body>404 Not Found</body></html>"],
                         ids=["zero_bytes", "truncated_jpeg", "text_named_jpg"])
def test_decode_quarantines_unreadable_files(tmp_path, hopper_small, content):
    data = _jpeg(hopper_small)[:600] if content == "truncated" else content
    path = tmp_path / "broken.jpg"
    path.write_bytes(data)
    decoded = decode_image(path, CONFIG.max_pixels)
    assert not decoded.ok and decoded.image is None
    assert decoded.error.startswith("unreadable: ") and len(decoded.error) > len("unreadable: ")
    row = FilterChain(CONFIG).assess(path)
    assert (row["status"], row["reason"]) == ("quarantined", "unreadable")
    assert row["detail"] == decoded.error and row["width"] is None


def test_decode_rejects_images_over_the_pixel_limit(tmp_path, hopper_small):
    path = tmp_path / "big.jpg"
    path.write_bytes(_jpeg(hopper_small))
    decoded = decode_image(path, max_pixels=96 * 128 - 1)
    assert not decoded.ok and "max_pixels" in decoded.error


def test_decode_applies_exif_orientation(tmp_path):
    stored = np.zeros((20, 40, 3), np.uint8)
    stored[:, :20] = (255, 0, 0)  # left half red
    stored[:, 20:] = (0, 0, 255)  # right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: the viewer must rotate 90 degrees clockwise
    path = tmp_path / "rotated.jpg"
    path.write_bytes(_jpeg(stored, exif=exif.tobytes()))
    image = decode_image(path, CONFIG.max_pixels).image
    assert image.shape == (40, 20, 3)
    # After a clockwise turn the stored left (red) half is on top.
    top, bottom = image[:20].mean((0, 1)), image[20:].mean((0, 1))
    assert top[0] > 200 > top[2] and bottom[2] > 200 > bottom[0]


def test_decode_converts_greyscale_and_alpha_to_rgb(tmp_path):
    for mode, name in (("L", "grey.png"), ("RGBA", "alpha.png")):
        Image.new(mode, (30, 50)).save(tmp_path / name)
        image = decode_image(tmp_path / name, CONFIG.max_pixels).image
        assert image.shape == (50, 30, 3) and image.dtype == np.uint8


# ---- size and quality -----------------------------------------------------------------------


def test_size_scorer_reports_short_side():
    assert SizeScorer()(np.zeros((24, 32, 3), np.uint8)) == {"width": 32.0, "height": 24.0, "short_side": 24.0}


def test_blur_score_separates_sharp_from_blurred(hopper_small):
    quality = QualityScorer()
    sharp = quality(hopper_small)["sharpness"]
    blurred = quality(cv2.GaussianBlur(hopper_small, (0, 0), 3.0))["sharpness"]
    assert sharp > 5 * CONFIG.min_sharpness
    assert blurred < CONFIG.min_sharpness < sharp


@pytest.mark.parametrize("value", [0, 255])
def test_exposure_flags_black_and_white_frames(tmp_path, value):
    image = np.full((128, 96, 3), value, np.uint8)
    scores = QualityScorer()(image)
    lo, hi = CONFIG.brightness_range
    assert not lo <= scores["brightness"] <= hi
    assert scores["clipped_fraction"] == 1.0
    path = tmp_path / "flat.png"
    Image.fromarray(image).save(path)
    row = FilterChain(CONFIG).assess(path)
    assert row["reason"] == "low_quality" and row["detail"].startswith("exposure")


def test_blur_threshold_holds_across_resolutions(hopper):
    # The same photo at 2x its size: at native scale its Laplacian variance collapses, at the
    # bounded analysis scale it stays close to the original's.
    big = cv2.resize(hopper, (1024, 1200), interpolation=cv2.INTER_CUBIC)
    ref = QualityScorer(analysis_short_side=256)(hopper)["sharpness"]
    bounded = QualityScorer(analysis_short_side=256)(big)["sharpness"]
    native = QualityScorer(analysis_short_side=10_000)(big)["sharpness"]
    assert ref / 2 < bounded < ref * 2
    assert native < ref / 4


def test_score_batch_applies_a_scorer_to_each_image(hopper_small):
    batch = np.stack([hopper_small, np.zeros_like(hopper_small)])
    scores = score_batch(QualityScorer(), batch)
    assert len(scores) == 2 and scores[0]["sharpness"] > scores[1]["sharpness"] == 0.0


# ---- text overlay ---------------------------------------------------------------------------


def test_text_score_flags_captions_but_not_clean_photos(hopper_small):
    text = TextOverlayScorer()
    clean = text(hopper_small)["text_score"]
    captioned = text(caption(hopper_small, ["Vs6 wy 73i", "PrL0u ZCA7", "hWK 3D SK35", "ok BUY now"]))["text_score"]
    assert clean < CONFIG.max_text_score < captioned
    assert text(landscape())["text_score"] < CONFIG.max_text_score


def test_text_glyphs_reject_filled_blobs():
    # A row of filled squares looks like a line of characters to a naive blob chainer.
    image = np.full((128, 96, 3), 200, np.uint8)
    for x in range(4, 90, 10):
        image[60:68, x:x + 7] = 20
    assert TextOverlayScorer()(image)["text_score"] == 0.0


# ---- person ---------------------------------------------------------------------------------


def test_person_detector_finds_a_person_and_not_a_landscape(hopper, hopper_small):
    detector = PersonDetector(PersonDetectorConfig())
    for image in (hopper, hopper_small):
        scores = detector(image)
        assert scores["num_persons"] >= 1 and scores["person_area"] > 0.05
    empty = detector(landscape())
    assert empty["num_persons"] == 0 and empty["person_area"] == 0.0


def test_face_fallback_finds_a_portrait_that_body_detectors_miss(hopper):
    # min_score=10 keeps every HOG window below the bar, so only the cascades can answer; the
    # full-body cascade misses a head-and-shoulders portrait, the face cascade finds it.
    body_cascade_only = PersonDetector(PersonDetectorConfig(min_score=10.0, use_face_cascade=False))
    with_face = PersonDetector(PersonDetectorConfig(min_score=10.0))
    assert body_cascade_only(hopper)["num_persons"] == 0
    found = with_face(hopper)
    assert found["num_persons"] == 1 and 0.05 < found["person_area"] < 0.5
    assert with_face(landscape())["num_persons"] == 0


# ---- dedup ----------------------------------------------------------------------------------


def test_bktree_radius_query_matches_brute_force():
    rng = np.random.default_rng(0)
    values = [int(v) for v in rng.integers(0, 2**63, 300)]
    # Plant near neighbours: flip 1-5 bits of some values.
    flips = [rng.choice(64, rng.integers(1, 6), replace=False) for _ in range(50)]
    values += [v ^ sum(1 << int(b) for b in bits) for v, bits in zip(values[:50], flips)]
    tree = BKTree()
    for i, v in enumerate(values):
        tree.add(v, i)
    for query in values[:60]:
        expected = {i for i, v in enumerate(values) if hamming(query, v) <= 6}
        assert set(tree.query(query, 6)) == expected


def test_group_duplicates_is_transitive_and_picks_the_priority_minimum():
    sizes = [100, 400, 400, 50, 70]
    paths = ["a", "c", "b", "d", "e"]
    groups = group_duplicates(5, [(0, 1), (1, 2), (3, 4)], lambda i: (-sizes[i], paths[i]))
    # 0-1-2 chain into one group; 1 and 2 tie on size, so the smaller path "b" (index 2) wins.
    assert groups.representative == [2, 2, 2, 4, 4]
    assert [groups.is_duplicate(i) for i in range(5)] == [True, True, False, True, False]
    assert group_duplicates(2, [], lambda i: i).representative == [None, None]


def test_near_duplicates_are_grouped_and_the_largest_copy_represents_them(hopper):
    base = cv2.resize(hopper, (96, 128), interpolation=cv2.INTER_AREA)
    copies = {
        "a_original": base,
        "b_upscaled": cv2.resize(base, (120, 160), interpolation=cv2.INTER_LINEAR),
        "c_recompressed": np.asarray(Image.open(io.BytesIO(_jpeg(base, quality=60)))),
        "d_cropped": cv2.resize(base[5:-4, 3:-4], (90, 120)),
        "e_other": landscape(),
        "f_other_shifted": landscape(seed=40),
    }
    names = sorted(copies)
    phash = PhashScorer(CONFIG.phash_size)
    hashes = [phash(copies[n])["phash"] for n in names]
    pairs = candidate_pairs(hashes, CONFIG.phash_hamming)
    keypoints = [orb_keypoints(copies[n]) for n in names]
    edges = [(i, j) for i, j, _ in pairs if similarity_inliers(keypoints[i], keypoints[j]) >= CONFIG.dup_min_inliers]
    area = [copies[n].shape[0] * copies[n].shape[1] for n in names]
    groups = group_duplicates(len(names), edges, lambda i: (-area[i], names[i]))
    rep = {names[i]: (names[r] if r is not None else None) for i, r in enumerate(groups.representative)}
    for name in ("a_original", "b_upscaled", "c_recompressed", "d_cropped"):
        assert rep[name] == "b_upscaled"
    assert rep["e_other"] != "b_upscaled" and rep["f_other_shifted"] != "b_upscaled"


# ---- split and config -----------------------------------------------------------------------


def test_split_is_a_stable_function_of_the_id():
    ids = [f"{i:06d}" for i in range(4000)]
    splits = [assign_split(i, 0.15) for i in ids]
    assert splits == [assign_split(i, 0.15) for i in ids]
    assert 0.12 < splits.count("val") / len(ids) < 0.18
    assert {assign_split(i, 0.0) for i in ids} == {"train"}


def test_config_errors_name_the_field():
    with pytest.raises(ValidationError, match="min_short_side"):
        CurationConfig(min_short_side=0)
    with pytest.raises(ValidationError, match="not_a_field"):
        CurationConfig(not_a_field=1)
    with pytest.raises(ValidationError, match="brightness_range"):
        CurationConfig(brightness_range=(200, 100))
    with pytest.raises(ValidationError, match="phash_hamming"):
        CurationConfig(phash_size=4, phash_hamming=17)
    with pytest.raises(ValidationError, match="person.min_face_fraction|min_face_fraction"):
        CurationConfig(person={"min_face_fraction": 2.0})
    with pytest.raises(ValidationError, match="frozen"):
        CONFIG.min_short_side = 10


def test_config_from_yaml(tmp_path: Path):
    good = tmp_path / "good.yaml"
    good.write_text("min_short_side: 384\nperson:\n  target_height: 256\nval_fraction: 0.2\n")
    config = CurationConfig.from_yaml(good)
    assert (config.min_short_side, config.person.target_height, config.val_fraction) == (384, 256, 0.2)
    bad = tmp_path / "bad.yaml"
    bad.write_text("person:\n  min_area_fraction: 3\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*person\.min_area_fraction"):
        CurationConfig.from_yaml(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"list\.yaml.*mapping"):
        CurationConfig.from_yaml(listed)


def test_score_fingerprint_covers_model_bytes_and_package_versions(tmp_path: Path, monkeypatch) -> None:
    import importlib.metadata

    from pipelines.common import shard_scores

    model = tmp_path / "person.onnx"
    model.write_bytes(b"weights v1")
    config = CurationConfig(onnx_person={"model": str(model)})
    first = shard_scores.config_fingerprint(config)
    assert shard_scores.config_fingerprint(config) == first
    model.write_bytes(b"weights v2, same path")
    assert shard_scores.config_fingerprint(config) != first, "new model bytes must invalidate cached scores"

    before = shard_scores.config_fingerprint(CurationConfig())
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "99.0" if name == "opencv-python-headless" else real_version(name))
    shard_scores._code_digest.cache_clear()
    try:
        assert shard_scores.config_fingerprint(CurationConfig()) != before, "a new OpenCV must invalidate cached scores"
    finally:
        monkeypatch.undo()
        shard_scores._code_digest.cache_clear()


def test_pools_refuse_links_and_special_files_before_reading_or_copying(tmp_path: Path) -> None:
    import os

    from pipelines.synth import fetch_raw_pool
    from sapiens2.curation.pool import list_inputs

    secret = tmp_path / "outside" / "secret.jpg"
    secret.parent.mkdir()
    secret.write_bytes(b"not pool data")
    pool = tmp_path / "pool"
    (pool / "images" / "nested").mkdir(parents=True)
    (pool / "images" / "a.jpg").write_bytes(b"jpeg")
    (pool / "images" / "nested" / "b.jpg").symlink_to(secret)
    with pytest.raises(ValueError, match=r"b\.jpg: a symbolic link .*secret\.jpg"):
        list_inputs(pool)
    dest = tmp_path / "raw"
    dest.mkdir()
    (dest / "kept.txt").write_text("the previous pool")
    with pytest.raises(ValueError, match="symbolic link"):
        fetch_raw_pool(str(pool), dest)
    assert (dest / "kept.txt").is_file(), "a refused fetch leaves the previous pool in place"

    (pool / "images" / "nested" / "b.jpg").unlink()
    (pool / "images" / "linked_dir").symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(ValueError, match="linked_dir: a symbolic link"):
        list_inputs(pool)
    (pool / "images" / "linked_dir").unlink()
    os.mkfifo(pool / "images" / "c.jpg")
    with pytest.raises(ValueError, match=r"c\.jpg: not a regular file"):
        list_inputs(pool)
    (pool / "images" / "c.jpg").unlink()
    assert [p.name for p in list_inputs(pool)] == ["a.jpg"]


def test_the_curate_step_never_replaces_a_folder_holding_its_inputs(tmp_path: Path) -> None:
    from pipelines.curate import curate_step

    raw = tmp_path / "data" / "raw"
    (raw / "images").mkdir(parents=True)
    (raw / "images" / "a.jpg").write_bytes(b"jpeg")
    with pytest.raises(ValueError, match="curating would delete them"):
        curate_step(raw, tmp_path / "data", CurationConfig(workers=1))
    assert (raw / "images" / "a.jpg").is_file()
