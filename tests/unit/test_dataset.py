"""CuratedDataset + collate: contract shapes, label validation, flip and resize consistency."""

from __future__ import annotations

import importlib.util

import cv2
import numpy as np
import pandas as pd
import pytest
import torch

from sapiens2.data.dataset import IMAGE_MEAN, IMAGE_STD, CuratedDataset, collate, hflip_sample
from sapiens2.labels import COCO_FLIP_PAIRS, COCO_SKELETON, SEG_CLASSES, SEG_FLIP

H, W = 32, 24
FX, CX, CY = 30.0, 11.3, 16.0  # off-centre principal point so the cx mirror is exercised


def make_labels(rng: np.random.Generator) -> dict[str, np.ndarray]:
    rows, cols = np.mgrid[0:H, 0:W]
    mask = (cols >= 4) & (cols < 20) & (rows >= 2) & (rows < 30)
    z = 2.0 + 0.01 * cols + 0.02 * rows
    points = (
        np.stack([(cols + 0.5 - CX) * z / FX, (rows + 0.5 - CY) * z / FX, z], -1) * mask[..., None]
    )
    seg = np.where(
        mask,
        np.where(cols < 12, SEG_CLASSES.index("Left_Hand"), SEG_CLASSES.index("Right_Hand")),
        0,
    )
    seg[2, 4:20] = SEG_CLASSES.index("Torso")
    normal = (
        np.stack([np.full((H, W), 0.6), np.zeros((H, W)), np.full((H, W), -0.8)], -1)
        * mask[..., None]
    )
    keypoints = np.concatenate(
        [rng.uniform([1, 1], [W - 1, H - 1], (17, 2)), np.full((17, 1), 2.0)], 1
    )
    return {
        "keypoints": keypoints.astype(np.float32),
        "seg": seg.astype(np.uint8),
        "mask": mask,
        "normal": normal.astype(np.float16),
        "pointmap": points.astype(np.float32),
        "albedo": rng.integers(0, 256, (H, W, 3), dtype=np.uint8),
        "K": np.array([[FX, 0, CX], [0, FX, CY], [0, 0, 1]], np.float32),
        "bbox": np.array([4, 2, 20, 30], np.float32),
    }


@pytest.fixture()
def curated(tmp_path):
    """Five images: three kept train, one kept val, one rejected."""
    rng = np.random.default_rng(0)
    (tmp_path / "images").mkdir()
    (tmp_path / "labels").mkdir()
    rows = []
    for i, (status, split) in enumerate(
        [
            ("kept", "train"),
            ("kept", "val"),
            ("rejected", None),
            ("kept", "train"),
            ("kept", "train"),
        ]
    ):
        image_id = f"{i:05d}"
        image = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
        cv2.imwrite(str(tmp_path / "images" / f"{image_id}.png"), image[..., ::-1])
        np.savez(tmp_path / "labels" / f"{image_id}.npz", **make_labels(rng))
        rows.append(
            {"id": image_id, "path": f"images/{image_id}.png", "status": status, "split": split}
        )
    pd.DataFrame(rows).to_parquet(tmp_path / "manifest.parquet")
    return tmp_path


def test_batch_follows_the_contract(curated):
    ds = CuratedDataset(curated, "train", height=H, width=W)
    assert len(ds) == 3 and ds.ids == ["00000", "00003", "00004"] and ds.hflip_prob == 0.5
    assert CuratedDataset(curated, "val", height=H, width=W).hflip_prob == 0.0
    batch = collate([ds[i] for i in range(3)])
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in batch.items() if k != "id"}
    assert shapes == {
        "image": ((3, 3, H, W), torch.float32),
        "image_uint8": ((3, H, W, 3), torch.uint8),
        "keypoints": ((3, 17, 3), torch.float32),
        "seg": ((3, H, W), torch.int64),
        "mask": ((3, H, W), torch.bool),
        "normal": ((3, 3, H, W), torch.float32),
        "pointmap": ((3, 3, H, W), torch.float32),
        "albedo": ((3, 3, H, W), torch.float32),
        "K": ((3, 3, 3), torch.float32),
        "bbox": ((3, 4), torch.float32),
    }
    assert batch["id"] == ["00000", "00003", "00004"]
    expected = (
        batch["image_uint8"].permute(0, 3, 1, 2).float() - torch.tensor(IMAGE_MEAN)[:, None, None]
    ) / torch.tensor(IMAGE_STD)[:, None, None]
    torch.testing.assert_close(batch["image"], expected)
    assert 0.0 <= batch["albedo"].min() and batch["albedo"].max() <= 1.0
    stored = cv2.imread(str(curated / "images" / "00003.png"))[..., ::-1]
    flipped = ds[1]["image"]
    assert (flipped == stored).all() or (flipped == stored[:, ::-1]).all()


def test_task_subset_reads_only_needed_fields(curated):
    sample = CuratedDataset(curated, "val", height=H, width=W, tasks=("seg",))[0]
    assert set(sample) == {"id", "image", "seg", "mask", "K", "bbox"}
    with pytest.raises(ValueError, match="unknown tasks"):
        CuratedDataset(curated, "val", tasks=("depth",))


def test_hflip_keeps_every_label_consistent():
    rng = np.random.default_rng(1)
    sample = {
        "id": "x",
        "image": rng.integers(0, 256, (H, W, 3), dtype=np.uint8),
        **make_labels(rng),
    }
    out = hflip_sample(sample, COCO_FLIP_PAIRS, SEG_FLIP)
    assert (out["image"] == sample["image"][:, ::-1]).all()
    # Keypoint 5 (left shoulder) lands where the mirrored right shoulder (6) was.
    assert out["keypoints"][5, 0] == pytest.approx(W - sample["keypoints"][6, 0])
    assert out["keypoints"][0, 0] == pytest.approx(W - sample["keypoints"][0, 0])
    left, right, torso = (SEG_CLASSES.index(n) for n in ("Left_Hand", "Right_Hand", "Torso"))
    assert out["seg"][10, W - 1 - 5] == right and out["seg"][10, W - 1 - 15] == left
    assert out["seg"][2, W - 1 - 10] == torso
    assert out["normal"][10, 10, 0] == pytest.approx(-0.6, abs=1e-3)
    # The mirrored pointmap still projects through the mirrored K onto pixel centres.
    m = out["mask"]
    u = (
        out["K"][0, 0] * out["pointmap"][..., 0] / np.where(m, out["pointmap"][..., 2], 1)
        + out["K"][0, 2]
    )
    cols = np.broadcast_to(np.arange(W) + 0.5, (H, W))
    np.testing.assert_allclose(u[m], cols[m], atol=1e-4)
    np.testing.assert_allclose(out["bbox"], [W - 20, 2, W - 4, 30])
    twice = hflip_sample(out, COCO_FLIP_PAIRS, SEG_FLIP)
    for key in ("image", "keypoints", "seg", "normal", "pointmap", "K", "bbox", "mask", "albedo"):
        np.testing.assert_allclose(twice[key], sample[key], atol=1e-5, err_msg=key)


def test_flip_decisions_are_reproducible(curated):
    a = CuratedDataset(curated, "train", height=H, width=W, hflip_prob=0.5, seed=3)
    b = CuratedDataset(curated, "train", height=H, width=W, hflip_prob=0.5, seed=3)
    decisions = []
    for epoch in range(6):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        for i in range(len(a)):
            np.testing.assert_array_equal(a[i]["image"], b[i]["image"])
            decisions.append(bool(a[i]["K"][0, 2] != CX))
    assert 0 < sum(decisions) < len(decisions)  # some flipped, some not


def test_resize_scales_coordinates_with_the_image(curated):
    ds = CuratedDataset(curated, "val", height=2 * H, width=2 * W)
    raw = CuratedDataset(curated, "val", height=H, width=W)[0]
    big = ds[0]
    assert big["image"].shape == (2 * H, 2 * W, 3) and big["seg"].shape == (2 * H, 2 * W)
    np.testing.assert_allclose(big["keypoints"][:, :2], raw["keypoints"][:, :2] * 2)
    np.testing.assert_allclose(big["K"][:2], raw["K"][:2] * 2)
    np.testing.assert_array_equal(big["seg"][::2, ::2], raw["seg"])


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("keypoints", np.zeros((16, 3), np.float32), "keypoints"),
        ("seg", np.full((H, W), 40, np.uint8), "seg"),
        ("normal", np.zeros((H, W - 1, 3), np.float16), "normal"),
        ("mask", np.zeros((H + 1, W), bool), "mask"),
    ],
)
def test_bad_labels_name_the_file_and_field(curated, field, value, message):
    path = curated / "labels" / "00001.npz"
    labels = dict(np.load(path))
    labels[field] = value
    np.savez(path, **labels)
    with pytest.raises(ValueError, match=f"00001.npz.*{message}"):
        CuratedDataset(curated, "val", height=H, width=W)[0]


def test_missing_label_field_is_reported(curated):
    path = curated / "labels" / "00001.npz"
    labels = dict(np.load(path))
    del labels["albedo"]
    np.savez(path, **labels)
    with pytest.raises(ValueError, match="00001.npz.*albedo"):
        CuratedDataset(curated, "val", height=H, width=W)[0]


needs_synth = pytest.mark.skipif(
    importlib.util.find_spec("sapiens2.data.synth") is None, reason="synth generator not present"
)


@needs_synth
def test_flip_is_consistent_on_rendered_people(tmp_path):
    from sapiens2.data.synth import render_person, write_sample

    rng = np.random.default_rng(0)
    (tmp_path / "images").mkdir()
    (tmp_path / "labels").mkdir()
    for i in range(3):
        person = render_person(rng)
        cv2.imwrite(str(tmp_path / "images" / f"{i:05d}.png"), person.image[..., ::-1])
        write_sample(tmp_path / "labels" / f"{i:05d}.npz", person)
    ids = [f"{i:05d}" for i in range(3)]
    manifest = {"id": ids, "path": [""] * 3, "status": ["kept"] * 3, "split": ["train"] * 3}
    pd.DataFrame(manifest).to_parquet(tmp_path / "manifest.parquet")
    plain = CuratedDataset(tmp_path, "train", hflip_prob=0.0)
    flipped = CuratedDataset(tmp_path, "train", hflip_prob=1.0)
    for i in range(3):
        a, b = plain[i], flipped[i]
        height, width = b["mask"].shape
        rows, cols = np.mgrid[0:height, 0:width]
        m, p, K = b["mask"], b["pointmap"], b["K"]
        u = K[0, 0] * p[..., 0][m] / p[..., 2][m] + K[0, 2]
        v = K[1, 1] * p[..., 1][m] / p[..., 2][m] + K[1, 2]
        np.testing.assert_allclose(u, cols[m] + 0.5, atol=1e-3)
        np.testing.assert_allclose(v, rows[m] + 0.5, atol=1e-3)
        # Each keypoint of the flipped sample sits on the mirrored class of its partner.
        partner = list(range(17))
        for left, right in COCO_FLIP_PAIRS:
            partner[left], partner[right] = right, left
        for k in range(17):
            x, y, vis = b["keypoints"][k]
            if vis > 0 and 0 <= x < width and 0 <= y < height:
                xa, ya, _ = a["keypoints"][partner[k]]
                assert b["seg"][int(y), int(x)] == SEG_FLIP[a["seg"][int(ya), int(xa)]]


@needs_synth
def test_flip_maps_agree_with_the_synthetic_generator():
    from sapiens2.data import synth

    assert tuple(synth.FLIP_PAIRS) == COCO_FLIP_PAIRS and tuple(synth.SKELETON) == COCO_SKELETON
    assert (
        tuple(synth.SEG_CLASSES) == SEG_CLASSES
        and tuple(int(i) for i in synth.SEG_FLIP) == SEG_FLIP
    )


def test_training_reads_images_as_curation_judged_them(tmp_path) -> None:
    """EXIF rotation, 16-bit scaling and alpha on white: the dataset loaders share curation's
    decoder (cv2.imread and Image.convert("RGB") would give a sideways, white or black image)."""
    from PIL import Image

    from sapiens2.data.decode import decode_image
    from sapiens2.data.formats.common import read_rgb
    from sapiens2.data.images import load_split_images

    tall = np.zeros((40, 20, 3), np.uint8)
    tall[:10] = 255  # a white top band: which way is up
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated; a viewer turns it upright
    root = tmp_path / "curated"
    (root / "images").mkdir(parents=True)
    Image.fromarray(np.rot90(tall, 1)).save(root / "images" / "a.jpg", exif=exif.tobytes(), quality=100)
    grey16 = Image.fromarray(np.full((40, 20), 32896, np.uint16))
    grey16.save(root / "images" / "b.png")
    rgba = np.zeros((40, 20, 4), np.uint8)  # fully transparent black pixels
    Image.fromarray(rgba, "RGBA").save(root / "images" / "c.png")
    pd.DataFrame([{"id": k, "path": f"images/{k}{ext}", "status": "kept", "split": "train"}
                  for k, ext in (("a", ".jpg"), ("b", ".png"), ("c", ".png"))]).to_parquet(root / "manifest.parquet")
    images, ids = load_split_images(root, "train", (40, 20))
    assert ids == ["a", "b", "c"]
    for name, loaded in zip(("a.jpg", "b.png", "c.png"), images):
        judged = decode_image(root / "images" / name, 10**8).image
        np.testing.assert_array_equal(loaded, judged)
        np.testing.assert_array_equal(read_rgb(root / "images" / name), judged)
    assert images[0][:10].mean() > 200 and images[0][-10:].mean() < 50, "EXIF rotation applied"
    assert abs(int(images[1].mean()) - 128) <= 1, "16-bit scaled, not clipped to white"
    assert images[2].min() == 255, "transparent pixels on white, not black"
