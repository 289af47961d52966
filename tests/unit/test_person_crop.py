"""Top-down person crop: the padded box fills the frame, labels follow it, OKS is unchanged;
and the curated dataset's decoded-sample cache hands out equal, independent samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

import sapiens2.data.dataset as dataset_module
from sapiens2.data.augment import person_crop
from sapiens2.data.dataset import CuratedDataset
from sapiens2.data.synth import render_person, write_sample
from sapiens2.tasks import get_task

H, W = 128, 96
FIELDS = ("image", "keypoints", "seg", "mask", "normal", "pointmap", "albedo", "K", "bbox")


def person(seed: int) -> dict:
    sample = render_person(np.random.default_rng(seed), H, W)
    return {k: getattr(sample, k) for k in FIELDS}


def write_curated(root: Path, n: int = 4, labelled: bool = True) -> Path:
    """Rendered people, every third in val: a curated folder (labels/ only when `labelled`)."""
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    rows = []
    for i in range(n):
        sample = render_person(np.random.default_rng(1000 + i), H, W)
        Image.fromarray(sample.image).save(root / "images" / f"{i:04d}.png")
        if labelled:
            write_sample(root / "labels" / f"{i:04d}.npz", sample)
        rows.append({"id": f"{i:04d}", "path": f"images/{i:04d}.png", "status": "kept", "reason": None,
                     "split": "val" if i % 3 == 2 else "train"})
    pd.DataFrame(rows).to_parquet(root / "manifest.parquet")
    return root


@pytest.fixture(scope="module")
def people() -> list[dict]:
    return [person(seed) for seed in range(4)]


def box_sides(box: np.ndarray) -> np.ndarray:
    return np.array([box[2] - box[0], box[3] - box[1]], np.float64)


def projection_error(sample: dict) -> np.ndarray:
    """Pixels between each masked pixel's centre and its pointmap projected through K."""
    rows, cols = np.nonzero(sample["mask"])
    uvw = sample["pointmap"][rows, cols].astype(np.float64) @ sample["K"].astype(np.float64).T
    return np.linalg.norm(uvw[:, :2] / uvw[:, 2:] - np.stack([cols + 0.5, rows + 0.5], 1), axis=1)


@pytest.mark.parametrize("padding", [1.25, 1.6])
def test_padded_box_fills_the_frame_centred(people, padding):
    for sample in people:
        out = person_crop(sample, padding)
        box = out["bbox"].astype(np.float64)
        centre = (box[:2] + box[2:]) / 2
        assert np.abs(centre - [W / 2, H / 2]).max() <= 1.0
        frame = np.array([W, H], np.float64)
        side = int(np.argmax(box_sides(box) / frame))  # the side that limits the zoom
        assert abs(box_sides(box)[side] - frame[side] / padding) <= 1.0


def test_crop_zooms_in_on_a_small_person(people):
    # Every rendered person is smaller than the padded frame in at least one side, so the crop
    # must change the box: a crop that returned its input would pass the centring test by chance.
    for sample in people:
        before, after = box_sides(sample["bbox"]), box_sides(person_crop(sample)["bbox"])
        assert not np.allclose(before, after)


def test_keypoints_keep_their_box_normalised_coordinates(people):
    for sample in people:
        out = person_crop(sample)
        b0, b1 = sample["bbox"], out["bbox"]
        norm_before = (sample["keypoints"][:, :2] - b0[:2]) / box_sides(b0)
        norm_after = (out["keypoints"][:, :2] - b1[:2]) / box_sides(b1)
        # Within a pixel of the new box (the box is re-measured from the resampled mask).
        assert (np.abs(norm_after - norm_before) * box_sides(b1)).max() <= 1.0
        assert np.array_equal(out["keypoints"][:, 2], sample["keypoints"][:, 2])


def test_intrinsics_still_project_the_pointmap_onto_the_pixels(people):
    for sample in people:
        out = person_crop(sample)
        assert out["mask"].sum() > 0.5 * sample["mask"].sum()
        assert projection_error(sample).max() <= 1.0
        assert projection_error(out).max() <= 1.0


@pytest.mark.parametrize("bbox", [[0, 0, 0, 0], [40, 30, 40, 90], [50, 30, 20, 90]])
def test_empty_box_leaves_the_sample_unchanged(people, bbox):
    sample = dict(people[0], bbox=np.array(bbox, np.float32))
    out = person_crop(sample)
    for field in FIELDS:
        assert np.array_equal(out[field], sample[field]), field


def coco_ap(sample: dict, predicted: np.ndarray) -> float:
    """OKS AP of one person through the pose task's metric, the prediction encoded as heatmaps."""
    task = get_task("pose")
    codec = task.codec((H // 4, W // 4), (H, W))
    heatmaps, _ = codec.encode(torch.from_numpy(predicted)[None].float())
    metric = task.metric()
    metric.update(heatmaps, {
        "id": ["0"], "image": torch.zeros(1, 3, H, W),
        "keypoints": torch.from_numpy(sample["keypoints"])[None], "bbox": torch.from_numpy(sample["bbox"])[None],
    })
    return metric.compute()["AP"]


def test_oks_ap_is_unchanged_by_the_crop(people):
    sample = people[0]
    rng = np.random.default_rng(1)
    angle = rng.uniform(0, 2 * np.pi, len(sample["keypoints"]))
    predicted = sample["keypoints"].copy()
    predicted[:, 0] += 5 * np.cos(angle)  # 5 px off: OKS passes some thresholds, not all
    predicted[:, 1] += 5 * np.sin(angle)
    predicted[:, 2] = 2
    before = coco_ap(sample, predicted)
    # The prediction moves exactly like the labels: the same crop of the same box.
    crop = person_crop(sample)
    moved = person_crop(dict(sample, keypoints=predicted))["keypoints"]
    after = coco_ap(crop, moved)
    assert 0.0 < before < 1.0
    assert after == pytest.approx(before, abs=1e-9)


@pytest.fixture(scope="module")
def curated(tmp_path_factory) -> Path:
    return write_curated(tmp_path_factory.mktemp("curated"))


def test_dataset_person_crop_is_the_crop_of_the_plain_sample(curated):
    plain = CuratedDataset(curated, "train", H, W, hflip_prob=0.0)
    cropped = CuratedDataset(curated, "train", H, W, hflip_prob=0.0, person_crop_padding=1.25)
    for index in range(len(plain)):
        expected = person_crop(plain[index], 1.25)
        got = cropped[index]
        assert not np.array_equal(got["image"], plain[index]["image"])
        for field in FIELDS:
            assert np.array_equal(got[field], expected[field]), field


def test_cached_sample_is_decoded_once_and_read_equal(curated, monkeypatch):
    calls = []
    load = dataset_module.load_curated_sample
    monkeypatch.setattr(dataset_module, "load_curated_sample", lambda *a, **k: calls.append(a) or load(*a, **k))
    data = CuratedDataset(curated, "train", H, W, person_crop_padding=1.25)
    first, second = data[0], data[0]
    assert len(calls) == 1
    for field in FIELDS:
        assert np.array_equal(first[field], second[field]), field


@pytest.mark.parametrize("split,hflip_prob", [("train", 0.0), ("train", 1.0), ("val", None)])
def test_mutating_a_read_sample_leaves_the_next_read_alone(curated, split, hflip_prob):
    data = CuratedDataset(curated, split, H, W, hflip_prob=hflip_prob, person_crop_padding=1.25)
    first = data[0]
    kept = {field: first[field].copy() for field in FIELDS}
    for field in FIELDS:
        first[field][...] = 0  # e.g. a caller normalising or masking in place
    again = data[0]
    for field in FIELDS:
        assert np.array_equal(again[field], kept[field]), f"{field} changed in the cache"
