"""Synthetic 308-keypoint labels: on their own body parts, mirror-consistent, deterministic, and
usable by the dataset, augmentation and pose task when configured; the default stays COCO-17."""

from __future__ import annotations

import cv2
import numpy as np
import pandas as pd
import pytest
import torch

from sapiens2.data.augment import Augment
from sapiens2.data.dataset import CuratedDataset, collate
from sapiens2.data.synth import render_person, write_sample
from sapiens2.data.synth.labels import KEYPOINT308_SEG_CLASSES, KEYPOINT_SEG_CLASSES
from sapiens2.labels.keypoints308 import KEYPOINT308_FLIP_PAIRS, KEYPOINT308_GROUPS, KEYPOINT308_NAMES
from sapiens2.labels import SEG_CLASSES, SEG_FLIP
from sapiens2.tasks import get_task

H, W = 128, 96
GROUP = {i: g for g, ix in KEYPOINT308_GROUPS.items() for i in ix}


@pytest.fixture(scope="module")
def samples():
    return [render_person(np.random.default_rng([123, i]), H, W, "sapiens308") for i in range(30)]


def test_seg_class_table_covers_the_308_set():
    assert len(KEYPOINT308_SEG_CLASSES) == 308
    assert KEYPOINT308_SEG_CLASSES[:17] == KEYPOINT_SEG_CLASSES
    left_hand, right_hand = SEG_CLASSES.index("Left_Hand"), SEG_CLASSES.index("Right_Hand")
    assert left_hand in KEYPOINT308_SEG_CLASSES[KEYPOINT308_NAMES.index("left_thumb_tip")]
    assert right_hand not in KEYPOINT308_SEG_CLASSES[KEYPOINT308_NAMES.index("left_thumb_tip")]


def test_308_mode_changes_only_the_keypoints_and_is_deterministic(samples):
    coco = render_person(np.random.default_rng([123, 0]), H, W)
    again = render_person(np.random.default_rng([123, 0]), H, W, "sapiens308")
    other = render_person(np.random.default_rng([123, 1]), H, W, "sapiens308")
    s = samples[0]
    assert s.keypoints.shape == (308, 3) and s.keypoints.dtype == np.float32
    assert set(np.unique(s.keypoints[:, 2])) <= {0.0, 1.0, 2.0}
    for key in ("image", "seg", "mask", "normal", "pointmap", "albedo", "K", "bbox"):
        assert np.array_equal(getattr(s, key), getattr(coco, key)), key
    assert np.array_equal(s.keypoints[:17], coco.keypoints)
    assert np.array_equal(s.keypoints, again.keypoints)
    assert not np.array_equal(s.keypoints, other.keypoints)
    with pytest.raises(ValueError, match="keypoint_set"):
        render_person(np.random.default_rng(0), H, W, "coco133")


def test_visible_keypoints_land_on_their_own_body_part(samples):
    counts = {g: [0, 0, 0] for g in KEYPOINT308_GROUPS}  # in image, visible, on own part
    for s in samples:
        for k, (x, y, v) in enumerate(s.keypoints):
            counts[GROUP[k]][0] += v > 0
            if v != 2:
                continue
            counts[GROUP[k]][1] += 1
            r, c = int(y), int(x)
            window = set(s.seg[max(r - 1, 0):r + 2, max(c - 1, 0):c + 2].ravel().tolist())
            counts[GROUP[k]][2] += bool(window & KEYPOINT308_SEG_CLASSES[k])
            side = KEYPOINT308_NAMES[k].split("_")[0]
            other = {"left": "Right_", "right": "Left_"}.get(side)
            if other and window - {0}:
                assert not all(SEG_CLASSES[c].startswith(other) for c in window - {0})
    for group, (in_image, visible, on_part) in counts.items():
        assert 0.3 < visible / in_image < 1.0, group  # self-occlusion hides some, not all
        assert on_part / visible >= 0.98, group


def test_left_landmarks_are_on_the_persons_left_in_frontal_views(samples):
    # Seen from the front, the person's left is on the image right: each visible face pair.
    index = {n: i for i, n in enumerate(KEYPOINT308_NAMES)}
    frontal = [s for s in samples if np.all(s.keypoints[[0, 1, 2]][:, 2] == 2)]
    assert len(frontal) >= 8
    pairs = [(a, b) for a, b in KEYPOINT308_FLIP_PAIRS if GROUP[a] == "face"]
    ordered = total = 0
    for s in frontal:
        for a, b in pairs:
            left, right = (a, b) if "_left_" in KEYPOINT308_NAMES[a] else (b, a)
            if s.keypoints[left, 2] == 2 and s.keypoints[right, 2] == 2:
                total += 1
                ordered += s.keypoints[left, 0] > s.keypoints[right, 0]
    assert total > 1000 and ordered / total >= 0.99
    hands = KEYPOINT308_GROUPS["hands"]
    right_hand, left_hand = list(hands[:20]), list(hands[20:])
    beside = []
    for s in frontal:
        both = (s.keypoints[left_hand, 2] == 2) & (s.keypoints[right_hand, 2] == 2)
        if both.any():
            beside.append(s.keypoints[left_hand, 0][both].mean() > s.keypoints[right_hand, 0][both].mean())
    assert len(beside) >= 8 and np.mean(beside) >= 0.9
    nose, chin = index["face_nose_bridge_4"], index["face_chin"]
    assert np.mean([s.keypoints[nose, 1] < s.keypoints[chin, 1] for s in frontal]) == 1.0


@pytest.fixture(scope="module")
def curated308(tmp_path_factory, samples):
    root = tmp_path_factory.mktemp("curated308")
    (root / "images").mkdir()
    (root / "labels").mkdir()
    ids = [f"{i:05d}" for i in range(3)]
    for i, sample_id in enumerate(ids):
        cv2.imwrite(str(root / "images" / f"{sample_id}.png"), samples[i].image[..., ::-1])
        write_sample(root / "labels" / f"{sample_id}.npz", samples[i])
    manifest = {"id": ids, "path": [""] * 3, "status": ["kept"] * 3, "split": ["train"] * 3}
    pd.DataFrame(manifest).to_parquet(root / "manifest.parquet")
    return root


def test_dataset_flip_and_pose_loss_work_with_308_keypoints(curated308):
    with pytest.raises(ValueError, match="keypoints"):  # the default expects 17
        CuratedDataset(curated308, "train", tasks=("pose",))[0]
    kw = dict(tasks=("pose", "seg"), num_keypoints=308, flip_pairs=KEYPOINT308_FLIP_PAIRS)
    plain = CuratedDataset(curated308, "train", hflip_prob=0.0, **kw)
    flipped = CuratedDataset(curated308, "train", hflip_prob=1.0, **kw)
    partner = list(range(308))
    for left, right in KEYPOINT308_FLIP_PAIRS:
        partner[left], partner[right] = right, left
    checked = 0
    for i in range(len(plain)):
        a, b = plain[i], flipped[i]
        for k in range(308):
            x, y, vis = b["keypoints"][k]
            if vis > 0 and 0 <= x < W and 0 <= y < H:
                xa, ya, _ = a["keypoints"][partner[k]]
                assert b["seg"][int(y), int(x)] == SEG_FLIP[a["seg"][int(ya), int(xa)]]
                checked += 1
    assert checked > 500
    warped = CuratedDataset(curated308, "train", augment=Augment(
        hflip_prob=0.5, affine_prob=1.0, flip_pairs=KEYPOINT308_FLIP_PAIRS), **kw)
    batch = collate([warped[i] for i in range(3)])
    assert batch["keypoints"].shape == (3, 308, 3)
    task = get_task("pose", keypoint_set="sapiens308")
    loss, log = task.loss(torch.zeros(3, 308, H // 4, W // 4), batch)
    assert loss.item() > 0 and np.isfinite(log["heatmap_mse"])


def test_pool_labels_308_keypoints_on_request_with_the_same_images(tmp_path):
    from sapiens2.data.synth import generate_pool, read_sample

    table = generate_pool(tmp_path / "coco", n_people=3, seed=3, workers=1, progress=False)
    generate_pool(tmp_path / "whole", n_people=3, seed=3, workers=1, progress=False,
                  keypoint_set="sapiens308")
    labelled = [i for i in table.id if (tmp_path / "coco" / "labels" / f"{i}.npz").is_file()]
    assert labelled
    for row in table.itertuples():
        a, b = (tmp_path / d / row.path for d in ("coco", "whole"))
        assert a.read_bytes() == b.read_bytes()
    for sample_id in labelled:
        coco = read_sample(tmp_path / "coco" / "labels" / f"{sample_id}.npz")
        whole = read_sample(tmp_path / "whole" / "labels" / f"{sample_id}.npz")
        assert coco["keypoints"].shape == (17, 3) and whole["keypoints"].shape == (308, 3)
        assert np.array_equal(whole["keypoints"][:17], coco["keypoints"])
        assert np.array_equal(whole["seg"], coco["seg"])
