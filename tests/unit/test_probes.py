"""Pretraining probes: viewpoint bins, weighted k-NN, patch part labels, part correspondence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sapiens2.data.normalize import normalize_images
from sapiens2.labels import SEG_CLASSES
from sapiens2.model import build_backbone
from sapiens2.pretrain.part_probes import (
    PART_GROUP_CLASSES,
    part_correspondence_accuracy,
    part_correspondence_chance,
    patch_image_identity,
    patch_part_labels,
)
from sapiens2.pretrain.probes import (
    BACK,
    FRONT,
    SIDE,
    UNDETERMINED,
    extract_features,
    knn_accuracy,
    majority_accuracy,
    run_probes,
    viewpoint_bins,
)

HEIGHT, WIDTH = 128, 96


def skeleton(shoulders=(60.0, 36.0), hips=(56.0, 40.0), labelled=(True, True, True, True)):
    """COCO-17 keypoints with only (left, right) shoulders at y=40 and hips at y=80 placed."""
    kp = np.zeros((17, 3), np.float32)
    for index, x, y, on in zip((5, 6, 11, 12), (*shoulders, *hips), (40, 40, 80, 80), labelled):
        kp[index] = (x, y, 2.0 if on else 0.0)
    return kp


def test_viewpoint_bins_of_hand_made_skeletons():
    skeletons = np.stack([
        skeleton(),  # left shoulder on the image's right: facing the camera
        skeleton(shoulders=(36.0, 60.0), hips=(40.0, 56.0)),  # mirrored: seen from behind
        skeleton(shoulders=(50.0, 46.0), hips=(49.0, 47.0)),  # |dx| = 3 < 0.25 * 40
        skeleton(labelled=(False, False, False, False)),
        skeleton(labelled=(False, False, True, True)),  # hips only: no torso height
        skeleton(labelled=(True, False, True, True)),  # hip offset decides, one shoulder suffices
    ])
    bins = viewpoint_bins(torch.from_numpy(skeletons))
    assert bins.dtype == np.int64
    assert bins.tolist() == [FRONT, BACK, SIDE, UNDETERMINED, UNDETERMINED, FRONT]


def test_knn_on_separable_clusters_is_perfect_and_ignores_unlabelled():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 16)) * 5
    train_labels, query_labels = rng.integers(0, 3, 90), rng.integers(0, 3, 40)
    train = centres[train_labels] + rng.normal(size=(90, 16)) * 0.3
    query = centres[query_labels] + rng.normal(size=(40, 16)) * 0.3
    query_labels[:5] = -1  # undetermined queries are dropped, not counted wrong
    train_labels[:5] = -1
    assert knn_accuracy(train, train_labels, query, query_labels) == pytest.approx(1.0)


def test_knn_on_shuffled_labels_is_near_the_majority_rate():
    rng = np.random.default_rng(1)
    train, query = rng.normal(size=(600, 32)), rng.normal(size=(400, 32))
    train_labels, query_labels = rng.integers(0, 3, 600), rng.integers(0, 3, 400)
    accuracy = knn_accuracy(train, train_labels, query, query_labels)
    assert abs(accuracy - majority_accuracy(train_labels, query_labels)) < 0.07
    # Imbalanced: with no signal the peaked votes cannot beat always saying the majority.
    probs = (0.6, 0.25, 0.15)
    train_labels, query_labels = rng.choice(3, 600, p=probs), rng.choice(3, 400, p=probs)
    accuracy = knn_accuracy(train, train_labels, query, query_labels)
    assert accuracy < majority_accuracy(train_labels, query_labels) + 0.03


def test_majority_accuracy_predicts_the_train_mode():
    assert majority_accuracy([0, 0, 1, -1, -1, -1], [0, 1, 1, -1]) == pytest.approx(1 / 3)


def test_patch_part_labels_of_a_hand_made_seg_map():
    cls = SEG_CLASSES.index
    seg = np.zeros((1, 32, 32), np.int64)  # 2x2 grid of 16 px patches, Background by default
    seg[0, :16, :16] = cls("Hair")
    seg[0, :16, 16:] = cls("Torso")
    seg[0, :4, 16:] = cls("Left_Hand")  # a quarter of the patch: torso stays the majority
    seg[0, 16:20, :16] = cls("Right_Upper_Leg")  # a quarter person: mostly background
    seg[0, 16:, 16:] = 255
    seg[0, 16:26, 16:] = cls("Right_Shoe")  # 10/16 rows: labelled, ignore counts as non-person
    labels = patch_part_labels(torch.from_numpy(seg), (2, 2), 16)
    assert labels.dtype == np.int64
    assert labels.tolist() == [[[0, 1], [-1, 4]]]


def test_every_body_part_class_has_one_group():
    grouped = [name for names in PART_GROUP_CLASSES.values() for name in names]
    assert sorted(grouped) == sorted(set(SEG_CLASSES) - {"Background"})


def random_part_labels(rng, num_images, grid=(8, 6)):
    labels = rng.integers(0, 5, (num_images, *grid))
    labels[rng.random(labels.shape) < 0.3] = -1
    return labels


def test_part_correspondence_of_one_hot_part_features_is_perfect():
    rng = np.random.default_rng(2)
    labels = random_part_labels(rng, 6)
    patches = np.eye(5)[labels.clip(0)] * (labels[..., None] >= 0)
    assert part_correspondence_accuracy(patches, labels) == pytest.approx(1.0)
    assert part_correspondence_chance(labels) < 0.4


def test_part_correspondence_of_random_features_is_near_chance():
    rng = np.random.default_rng(3)
    labels = random_part_labels(rng, 30)
    labels[labels == 4] = 0  # uneven group frequencies, so chance is not simply 1/5
    patches = rng.normal(size=(*labels.shape, 32))
    accuracy = part_correspondence_accuracy(patches, labels, max_pairs=500)
    chance = part_correspondence_chance(labels, max_pairs=500)
    assert abs(accuracy - chance) < 0.04


def test_patch_image_identity_is_high_for_image_codes_and_near_zero_for_part_codes():
    rng = np.random.default_rng(4)
    labels = random_part_labels(rng, 12)
    image_codes = rng.normal(size=(12, 1, 1, 32)) + 0.05 * rng.normal(size=(*labels.shape, 32))
    part_codes = rng.normal(size=(5, 32))[labels.clip(0)] + 0.05 * rng.normal(size=(*labels.shape, 32))
    assert patch_image_identity(image_codes, labels) > 0.9
    assert abs(patch_image_identity(part_codes, labels)) < 0.1


def test_patch_image_identity_equals_the_pairwise_cosines():
    rng = np.random.default_rng(5)
    labels = random_part_labels(rng, 4, grid=(3, 2))
    patches = rng.normal(size=(*labels.shape, 8)) + rng.normal(size=(4, 1, 1, 8))
    keep = labels.reshape(4, -1) != -1
    unit = patches.reshape(4, 6, 8) / np.linalg.norm(patches.reshape(4, 6, 8), axis=-1, keepdims=True)
    vectors = [(i, v) for i in range(4) for v, k in zip(unit[i], keep[i]) if k]
    within, across = [], []
    for n, (i, u) in enumerate(vectors):
        for m, (j, v) in enumerate(vectors):
            if n != m:
                (within if i == j else across).append(u @ v)
    assert patch_image_identity(patches, labels) == pytest.approx(np.mean(within) - np.mean(across))


def test_part_correspondence_chance_is_the_exact_expectation():
    labels = np.array([[[0, 0, 1, -1]], [[0, 1, 1, 1]]])
    # a's two group-0 patches match 1 of b's 4 patches, its group-1 patch 3 of 4.
    assert part_correspondence_chance(labels, pairs=[(0, 1)]) == pytest.approx((2 / 4 + 3 / 4) / 3)
    with pytest.raises(ValueError, match="different images"):
        part_correspondence_chance(labels, pairs=[(1, 1)])


def synthetic_batch(seed: int, size: int = 4) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    images = torch.from_numpy(rng.integers(0, 256, (size, HEIGHT, WIDTH, 3), dtype=np.uint8))
    views = [skeleton(), skeleton(shoulders=(36.0, 60.0), hips=(40.0, 56.0))]
    seg = np.zeros((size, HEIGHT, WIDTH), np.int64)
    seg[:, 16:48, 32:64] = SEG_CLASSES.index("Face_Neck")
    seg[:, 48:96, 16:80] = SEG_CLASSES.index("Torso")
    seg[:, 96:, 16:80] = SEG_CLASSES.index("Left_Upper_Leg")
    return {
        "image": normalize_images(images),
        "keypoints": torch.from_numpy(np.stack([views[i % 2] for i in range(size)])),
        "seg": torch.from_numpy(seg),
    }


@pytest.fixture(scope="module")
def backbone():
    torch.manual_seed(0)
    return build_backbone("sapiens2_debug", img_size=(HEIGHT, WIDTH))


def test_extract_features_matches_the_feature_map_and_restores_train_mode(backbone):
    batch = synthetic_batch(0, size=2)
    backbone.train()
    cls, patches = extract_features(backbone, [batch, batch])
    assert backbone.training
    assert cls.dtype == patches.dtype == np.float32
    assert cls.shape == (4, backbone.embed_dim)
    assert patches.shape == (4, HEIGHT // 16, WIDTH // 16, backbone.embed_dim)
    backbone.eval()
    with torch.no_grad():
        featmap = backbone(batch["image"], output="featmap").permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(patches[:2], featmap, atol=1e-5)
    extract_features(backbone, [batch])
    assert not backbone.training


def test_run_probes_gives_finite_values_for_a_random_backbone(backbone):
    result = run_probes(backbone, [synthetic_batch(1), synthetic_batch(2)], [synthetic_batch(3)])
    assert set(result) == {
        "knn_viewpoint_acc", "viewpoint_majority_acc", "part_correspondence_acc",
        "part_correspondence_chance", "patch_image_identity", "num_train_images", "num_val_images",
    }
    assert all(math.isfinite(v) for v in result.values())
    assert result["num_train_images"] == 8 and result["num_val_images"] == 4
    assert result["viewpoint_majority_acc"] == pytest.approx(0.5)
    assert 0.0 <= result["part_correspondence_chance"] <= 1.0
    assert 0.0 <= result["part_correspondence_acc"] <= 1.0
