"""Synthetic humans: determinism, label consistency and the web pool's bookkeeping."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sapiens2.data.synth import (EXPECTED, FLIP_PAIRS, KEYPOINT_NAMES, KEYPOINT_SEG_CLASSES, KINDS,
                                 SEG_CLASSES, SEG_FLIP, SKELETON, DistractorMix, generate_pool,
                                 read_sample, render_person, write_sample)
from sapiens2.data.synth.labels import SEG_ID
from sapiens2.data.decode import read_rgb as decode_image

H, W = 128, 96


@pytest.fixture(scope="module")
def samples():
    return [render_person(np.random.default_rng([123, i]), H, W) for i in range(40)]


def test_sample_fields_have_contract_shapes_and_dtypes(samples):
    s = samples[0]
    assert s.image.shape == (H, W, 3) and s.image.dtype == np.uint8
    assert s.keypoints.shape == (17, 3) and s.keypoints.dtype == np.float32
    assert s.seg.shape == (H, W) and s.seg.dtype == np.uint8 and s.seg.max() < len(SEG_CLASSES)
    assert s.mask.dtype == bool and s.normal.dtype == np.float32 and s.pointmap.dtype == np.float32
    assert s.albedo.shape == (H, W, 3) and s.albedo.dtype == np.uint8
    assert s.K.shape == (3, 3) and s.bbox.shape == (4,)
    assert set(np.unique(s.keypoints[:, 2])) <= {0.0, 1.0, 2.0}


def test_render_is_deterministic_per_seed():
    a = render_person(np.random.default_rng(5))
    b = render_person(np.random.default_rng(5))
    c = render_person(np.random.default_rng(6))
    for key in ("image", "seg", "normal", "pointmap", "keypoints", "albedo"):
        assert np.array_equal(getattr(a, key), getattr(b, key)), key
    assert not np.array_equal(a.image, c.image)


def test_dense_labels_are_consistent(samples):
    for s in samples:
        m = s.mask
        assert np.array_equal(s.seg == 0, ~m)
        norm = np.linalg.norm(s.normal, axis=2)
        assert np.allclose(norm[m], 1.0, atol=1e-4) and np.all(s.normal[~m] == 0)
        assert np.all(s.pointmap[~m] == 0) and np.all(s.albedo[~m] == 0)
        assert np.all(s.pointmap[m][:, 2] > 0)
        rows, cols = np.nonzero(m)
        proj = s.pointmap[rows, cols] @ s.K.T
        uv = proj[:, :2] / proj[:, 2:]
        assert np.abs(uv - np.stack([cols + 0.5, rows + 0.5], 1)).max() < 0.5
        # Normals face the camera: they point against the viewing ray.
        assert np.all(np.einsum("ij,ij->i", s.normal[m], s.pointmap[m]) < 1e-6)
        x0, y0, x1, y1 = s.bbox
        assert (x0, y0, x1, y1) == (cols.min(), rows.min(), cols.max() + 1, rows.max() + 1)


def test_people_fill_most_of_the_image_height(samples):
    fill = np.array([(s.bbox[3] - s.bbox[1]) / H for s in samples])
    assert fill.min() > 0.5 and fill.max() <= 0.95
    assert 0.65 < np.median(fill) < 0.85


def test_visible_keypoints_land_on_their_own_body_part(samples):
    hits, visible, in_image = 0, 0, 0
    for s in samples:
        for k, (x, y, v) in enumerate(s.keypoints):
            in_image += v > 0
            if v != 2:
                continue
            visible += 1
            r, c = int(y), int(x)
            window = set(s.seg[max(r - 1, 0):r + 2, max(c - 1, 0):c + 2].ravel().tolist())
            hits += bool(window & KEYPOINT_SEG_CLASSES[k])
            # A visible left joint never sits on right-side parts only (and vice versa).
            name = KEYPOINT_NAMES[k]
            other = "Right_" if name.startswith("left") else "Left_" if name.startswith("right") else None
            if other and window - {0}:
                assert not all(SEG_CLASSES[c].startswith(other) for c in window - {0}), name
    assert visible / in_image > 0.7  # most joints are visible, some are self-occluded
    assert visible < in_image
    assert hits / visible >= 0.98


def test_left_means_the_persons_own_left(samples):
    # Seen from the front (nose and both eyes visible) the person's left is on the image right.
    frontal = [s for s in samples if np.all(s.keypoints[:3, 2] == 2)]
    assert len(frontal) >= 10
    right_of = [s.keypoints[5, 0] > s.keypoints[6, 0] and s.keypoints[1, 0] > s.keypoints[2, 0]
                for s in frontal]
    assert np.mean(right_of) >= 0.9
    for s in frontal:
        left = np.nonzero(np.isin(s.seg, [SEG_ID["Left_Upper_Leg"], SEG_ID["Left_Lower_Leg"]]))[1]
        right = np.nonzero(np.isin(s.seg, [SEG_ID["Right_Upper_Leg"], SEG_ID["Right_Lower_Leg"]]))[1]
        if len(left) > 20 and len(right) > 20:
            assert left.mean() > right.mean() - 2


def test_rendered_classes_cover_the_body_part_set(samples):
    seen = set()
    for s in samples:
        seen |= set(np.unique(s.seg).tolist())
    required = ["Background", "Upper_Clothing", "Lower_Clothing", "Face_Neck", "Hair", "Torso"]
    for side in ("Left", "Right"):
        required += [f"{side}_{p}" for p in ("Upper_Arm", "Lower_Arm", "Hand", "Upper_Leg",
                                              "Lower_Leg", "Foot", "Shoe")]
    assert {SEG_ID[n] for n in required} <= seen


def test_flip_tables_swap_left_and_right():
    assert len(SEG_CLASSES) == 29 and np.array_equal(SEG_FLIP[SEG_FLIP], np.arange(29))
    for i, name in enumerate(SEG_CLASSES):
        flipped = SEG_CLASSES[SEG_FLIP[i]]
        assert flipped == name.replace("Left_", "@").replace("Right_", "Left_").replace("@", "Right_")
    for a, b in FLIP_PAIRS:
        assert KEYPOINT_NAMES[a].replace("left", "right") == KEYPOINT_NAMES[b]
    assert len(KEYPOINT_NAMES) == 17 and all(0 <= i < 17 for pair in SKELETON for i in pair)


def test_label_file_round_trip_is_byte_stable(tmp_path, samples):
    s = samples[0]
    write_sample(tmp_path / "a.npz", s)
    write_sample(tmp_path / "b.npz", s)
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    back = read_sample(tmp_path / "a.npz")
    for key in ("keypoints", "seg", "mask", "pointmap", "albedo", "K", "bbox"):
        assert np.array_equal(back[key], getattr(s, key)), key
    assert back["normal"].dtype == np.float32 and np.abs(back["normal"] - s.normal).max() < 1e-3


def test_distractor_mix_rejects_bad_shares():
    with pytest.raises(ValueError):
        DistractorMix(no_person=-0.1)
    with pytest.raises(ValueError):
        DistractorMix(no_person=0.5, duplicate=0.5)


def _digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    table = generate_pool(root / "a", n_people=14, seed=3, workers=2, progress=False)
    generate_pool(root / "b", n_people=14, seed=3, workers=1, progress=False)
    return root, table


def test_pool_is_deterministic_across_worker_counts(pool, tmp_path):
    root, _ = pool
    a = _digest(root / "a")
    assert a == _digest(root / "b")
    generate_pool(tmp_path, n_people=14, seed=4, workers=1, progress=False)
    other = _digest(tmp_path)
    assert sum(a[k] != other.get(k) for k in a) > len(a) // 2


def test_pool_table_counts_files_and_expectations(pool):
    root, table = pool
    root = root / "a"
    assert table.equals(pd.read_parquet(root / "pool_labels.parquet"))
    expected = {k: v for k, v in DistractorMix().counts(14).items() if v}
    assert table.kind.value_counts().to_dict() == expected
    assert set(table.kind) <= set(KINDS)
    assert table.id.is_unique and list(table.id) == sorted(table.id)
    for row in table.itertuples():
        assert (root / row.path).is_file()
        assert (row.expected_status, row.expected_reason) == EXPECTED[row.kind]
        has_labels = (root / "labels" / f"{row.id}.npz").is_file()
        assert has_labels == (row.kind in ("person", "duplicate", "text_overlay", "blurred"))
        data = (root / row.path).read_bytes()
        if row.kind == "corrupt":
            with pytest.raises(ValueError):
                decode_image(data)
            continue
        image = decode_image(data)
        if row.kind == "too_small":
            assert min(image.shape[:2]) < 64
        else:
            assert min(image.shape[:2]) >= 64
        if row.kind in ("duplicate", "near_duplicate"):
            assert row.source_id < row.id  # originals sort before their copies
            assert table.set_index("id").loc[row.source_id, "kind"] == "person"
        else:
            assert row.source_id is None


def test_duplicates_match_their_source_pixels_and_labels(pool):
    root, table = pool
    root = root / "a"
    paths = table.set_index("id").path
    for row in table[table.kind == "duplicate"].itertuples():
        dup = decode_image((root / row.path).read_bytes()).astype(float)
        src = decode_image((root / paths[row.source_id]).read_bytes()).astype(float)
        assert dup.shape == src.shape and np.abs(dup - src).mean() < 4.0
        a = read_sample(root / "labels" / f"{row.id}.npz")
        b = read_sample(root / "labels" / f"{row.source_id}.npz")
        assert np.array_equal(a["seg"], b["seg"]) and np.array_equal(a["keypoints"], b["keypoints"])
