"""Augmentation: labels follow the image through flip, scale/crop and rotation; photometric
distortion changes the image only."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sapiens2.data.augment import Augment, affine_sample, hflip_sample
from sapiens2.data.dataset import CuratedDataset
from sapiens2.data.synth import KEYPOINT_SEG_CLASSES, render_person
from sapiens2.labels import COCO_FLIP_PAIRS, SEG_CLASSES, SEG_FLIP
from sapiens2.tasks.keypoint_codec import flip_index
from sapiens2.tasks.pointmap import normals_from_pointmap
from tests.unit.test_dataset import curated  # noqa: F401 (fixture)

H, W = 128, 96
FLIP_INDEX = flip_index(17, COCO_FLIP_PAIRS)


def person(seed: int) -> dict:
    sample = render_person(np.random.default_rng(seed), H, W)
    fields = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
    return {"id": str(seed), **fields}


@pytest.fixture(scope="module")
def people() -> list[dict]:
    return [person(seed) for seed in range(6)]


def interior_keypoints(sample: dict, radius: int = 2) -> list[int]:
    """Visible keypoints whose (2r+1)^2 neighbourhood lies wholly on classes allowed for them."""
    good = []
    for k, (x, y, v) in enumerate(sample["keypoints"]):
        col, row = int(x), int(y)
        if v < 2 or not (radius <= col < W - radius and radius <= row < H - radius):
            continue
        patch = sample["seg"][row - radius : row + radius + 1, col - radius : col + radius + 1]
        if set(np.unique(patch).tolist()) <= KEYPOINT_SEG_CLASSES[k]:
            good.append(k)
    return good


def on_own_part(before: dict, after: dict, source_of: list[int]) -> tuple[int, int]:
    """(checked, correct): keypoints of `after` still inside the image whose source keypoint was
    interior in `before`, and how many of them sit on a class allowed for their index."""
    good = set(interior_keypoints(before))
    checked = correct = 0
    for k, (x, y, v) in enumerate(after["keypoints"]):
        if source_of[k] in good and v > 0:
            checked += 1
            correct += int(after["seg"][int(y), int(x)]) in KEYPOINT_SEG_CLASSES[k]
    return checked, correct


def test_keypoints_stay_on_their_body_part(people):
    rng = np.random.default_rng(0)
    total = 0
    for sample in people:
        flipped = hflip_sample(sample, COCO_FLIP_PAIRS, SEG_FLIP)
        checked, correct = on_own_part(sample, flipped, FLIP_INDEX)
        assert checked == correct and checked > 0
        for _ in range(3):
            scale, angle = rng.uniform(0.8, 1.3), rng.uniform(-40, 40)
            moved = affine_sample(sample, scale, angle, tuple(rng.uniform(-8, 8, 2)))
            checked, correct = on_own_part(sample, moved, list(range(17)))
            assert checked == correct, (scale, angle)
            total += checked
    assert total > 50


def test_flip_swaps_sides_and_negates_x(people):
    sample = people[0]
    out = hflip_sample(sample, COCO_FLIP_PAIRS, SEG_FLIP)
    left_hand = SEG_CLASSES.index("Left_Hand")
    assert np.array_equal(out["seg"] == SEG_CLASSES.index("Right_Hand"),
                          (sample["seg"] == left_hand)[:, ::-1])
    assert np.allclose(out["normal"][..., 0], -sample["normal"][:, ::-1, 0])
    assert np.allclose(out["normal"][..., 1:], sample["normal"][:, ::-1, 1:])
    assert np.allclose(out["keypoints"][5, 0], W - sample["keypoints"][6, 0])


def projection_error(sample: dict) -> np.ndarray:
    """Pixels between each masked pixel's centre and its pointmap projected through K."""
    rows, cols = np.nonzero(sample["mask"])
    points = sample["pointmap"][rows, cols].astype(np.float64)
    uvw = points @ sample["K"].astype(np.float64).T
    uv = uvw[:, :2] / uvw[:, 2:]
    return np.linalg.norm(uv - np.stack([cols + 0.5, rows + 0.5], 1), axis=1)


def facing(sample: dict) -> np.ndarray:
    """Cosine between each masked pixel's normal and its viewing ray, to 4 decimals."""
    normal, points = sample["normal"][sample["mask"]], sample["pointmap"][sample["mask"]]
    cos = (normal * points).sum(-1) / np.linalg.norm(points, axis=-1)
    return np.round(cos, 4)


def normal_vs_pointmap_deg(sample: dict) -> float:
    """Median angle between the normals and those derived from the pointmap (masked)."""
    points = torch.from_numpy(sample["pointmap"]).permute(2, 0, 1)[None].double()
    derived, valid = normals_from_pointmap(points, torch.from_numpy(sample["mask"])[None])
    derived = torch.nn.functional.normalize(derived, dim=1)[0].permute(1, 2, 0).numpy()
    normals = sample["normal"][:-1, :-1].astype(np.float64)
    cos = (derived * normals).sum(-1)[valid[0].numpy()]
    return float(np.degrees(np.median(np.arccos(np.clip(cos, -1, 1)))))


@pytest.mark.parametrize("scale,angle", [(1.0, 35.0), (1.25, -25.0), (0.8, 15.0)])
def test_rotation_keeps_geometry_consistent(people, scale, angle):
    for sample in people[:3]:
        out = affine_sample(sample, scale, angle, (3.0, -2.0))
        norms = np.linalg.norm(out["normal"][out["mask"]], axis=-1)
        assert np.allclose(norms, 1.0, atol=1e-3)
        assert not out["normal"][~out["mask"]].any()
        # K' still projects the pointmap onto the (nearest-resampled) pixel grid.
        assert np.median(projection_error(out)) < 1.0 and projection_error(out).max() < 2.0
        # A roll turns normals and points together: n . P / |P| moves with its pixel unchanged.
        assert np.isin(facing(out), facing(sample)).all()
        if scale <= 1.0:  # upsampling by nearest repeats pixels, leaving no differences to take
            assert normal_vs_pointmap_deg(out) < normal_vs_pointmap_deg(sample) + 5.0


def test_seg_ids_stay_valid(people):
    augment = Augment(hflip_prob=0.5, affine_prob=1.0, max_rotation_deg=45)
    for i, sample in enumerate(people):
        out = augment(sample, np.random.default_rng(i))
        ids = set(np.unique(out["seg"]).tolist())
        assert ids <= set(range(len(SEG_CLASSES)))
        assert ids - {0} <= set(np.unique(sample["seg"]).tolist()) | {SEG_FLIP[c] for c in ids}
        assert np.array_equal(out["mask"], out["seg"] > 0)


def test_photometric_never_touches_albedo_and_keeps_its_chromaticity(people):
    augment = Augment(hflip_prob=0.0, photometric_prob=1.0)
    sample = people[1]
    out = augment(sample, np.random.default_rng(3))
    assert np.array_equal(out["albedo"], sample["albedo"])
    assert not np.array_equal(out["image"], sample["image"])
    src, dst = sample["image"].astype(float), out["image"].astype(float)
    ok = (src > 20).all(-1) & (dst < 250).all(-1)
    ratio = dst[ok] / src[ok]
    assert ratio.std() < 0.05  # one gain for every pixel and channel: colour relations kept
    no_albedo = {k: v for k, v in sample.items() if k != "albedo"}
    hue_shifted = augment(no_albedo, np.random.default_rng(3))["image"].astype(float)
    assert (hue_shifted[ok] / src[ok]).std() > 0.05


def test_deterministic_from_the_generator(people):
    augment = Augment(affine_prob=1.0, photometric_prob=1.0)
    a = augment(people[2], np.random.default_rng([7, 1, 2]))
    b = augment(people[2], np.random.default_rng([7, 1, 2]))
    c = augment(people[2], np.random.default_rng([7, 2, 2]))
    assert all(np.array_equal(a[k], b[k]) for k in a if k != "id")
    assert not np.array_equal(a["image"], c["image"])


def test_default_recipe_is_flip_only_with_one_draw(people):
    sample = people[0]
    for seed in range(8):
        rng = np.random.default_rng(seed)
        flip = np.random.default_rng(seed).random() < 0.5
        out = Augment()(sample, rng)
        expected = hflip_sample(sample, COCO_FLIP_PAIRS, SEG_FLIP) if flip else sample
        assert all(np.array_equal(out[k], expected[k]) for k in sample if k != "id")


@pytest.mark.parametrize("field,value", [("hflip_prob", 1.5), ("scale_range", (1.2, 0.9)),
                                         ("brightness", 1.0), ("max_rotation_deg", -1.0)])
def test_rejects_bad_settings(field, value):
    with pytest.raises(ValueError, match=field):
        Augment(**{field: value})


def test_dataset_takes_an_augment_recipe(curated):
    recipe = Augment(hflip_prob=0.0, affine_prob=1.0, photometric_prob=1.0)
    plain = CuratedDataset(curated, "train", height=32, width=24, hflip_prob=0.0)
    augmented = CuratedDataset(curated, "train", height=32, width=24, augment=recipe, seed=1)
    again = CuratedDataset(curated, "train", height=32, width=24, augment=recipe, seed=1)
    assert not np.array_equal(plain[0]["image"], augmented[0]["image"])
    assert all(np.array_equal(augmented[0][k], again[0][k]) for k in plain[0] if k != "id")
    with pytest.raises(ValueError, match="either hflip_prob or augment"):
        CuratedDataset(curated, "train", hflip_prob=0.5, augment=recipe)
